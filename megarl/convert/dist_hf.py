"""HF safetensors ⇄ megatron dist checkpoint (torch_dist), layer by layer.

Both directions go through the one HF adapter (``megarl/models/hf_adapter.py``) and a
*skeleton*: the megatron GPTModel of the HF config built on the meta device (no memory), whose
``sharded_state_dict`` names every tensor as the trainer saves and loads it (global keys, layers
stacked on a leading axis — over the layers that have the key, ``layer_axis.py`` — experts on a
second, ``linear_fc1`` as gate and up halves).

- ``hf_to_mcore``: the whole plan (every megatron chunk, its shape and dtype) is made from the
  safetensors headers and checked against the skeleton first; then torch's checkpoint writer
  asks for one chunk at a time and the chunk's layer is read and converted on demand (one layer
  in memory). The checkpoint is unsharded (one chunk per layer), which megatron loads at any
  TP/PP/EP/VPP; the layout asked for is checked against the model and recorded.
- ``mcore_to_hf``: each layer's tensors are loaded from the dist checkpoint (a run's, saved at any
  layout, optimizer state ignored) by a partial load, converted, and handed to a sharded
  safetensors writer that writes each shard once complete.

Outputs are written to ``<out>.tmp`` and renamed at the end; every error that can be known
before writing (unknown architecture, a layout that does not divide the model, a missing or
truncated shard, tensors that do not match the model) is raised before the first byte.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from megarl.checkpoint.identity import check_same_model, model_tensor_shapes, recorded_source, saved_tensors
from megarl.checkpoint.layer_axis import compact_layer_keys
from megarl.checkpoint.run import newest_step_dir
from megarl.compat.megatron import activate_cpu
from megarl.config.validate.layout import check_model_layout
from megarl.convert.hf_files import ShardedWriter, copy_aux_files, nbytes, publish, staging_dir
from megarl.distributed.parallel import build_parallel_state
from megarl.models.hf_adapter import hf_to_megatron, megatron_to_hf
from megarl.models.hf_config import read_hf_config
from megarl.models.hf_reader import HFCheckpoint
from megarl.trainer.model import build_gpt_model

DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_LAYER = re.compile(r"^(?:model\.layers|decoder\.layers)\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(?:local_experts\.)?(\d+)\.")
GLOBAL = (-1, "")  # the group of embedding, final norm and output layer
CONVERSION_FILE = "megarl_conversion.json"


def group_of(name: str) -> tuple[int, str]:
    """The unit a tensor (HF or megatron name) is converted in: (layer, 'attn' | 'mlp' | 'expert E'),
    or ``GLOBAL``. Every fused tensor's parts fall in one unit; a unit is at most one layer's
    attention or dense MLP or one expert, so that is what a conversion holds in memory."""
    m = _LAYER.match(name)
    if m is None:
        return GLOBAL
    layer, rest = int(m.group(1)), m.group(2)
    e = _EXPERT.match(rest)
    if e is not None:
        return layer, f"expert {int(e.group(1)):06d}"
    return layer, "attn" if rest.startswith(("self_attn.", "self_attention.", "input_layernorm.")) else "mlp"


def skeleton_state(cfg: dict) -> dict:
    """The skeleton's sharded state dict, keys as the trainer saves them (``compact_layer_keys``:
    a key that only some layers have is stored over those layers)."""
    return compact_layer_keys([skeleton(cfg).sharded_state_dict()])[0]


def skeleton(cfg: dict):
    """The TP=1/PP=1 megatron model of ``cfg`` on the meta device (needs a world-1 parallel state)."""
    ps = build_parallel_state()
    activate_cpu()
    with torch.device("meta"):
        return build_gpt_model(cfg, ps)


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, dynamic_ncols=True)


def _shard_list(entries: dict) -> list:
    """The ShardedTensors of a (flat) sharded state dict, factories applied (meta or real data)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    applied = dict(entries)
    apply_factories(applied)
    return [v for v in nested_values(applied) if isinstance(v, ShardedTensor)]


def _with_data(entry, tensor: torch.Tensor):
    """A skeleton entry (ShardedTensor or factory) holding ``tensor`` (its dtype, not the skeleton's)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(entry, ShardedTensor):
        return dataclasses.replace(entry, data=tensor, dtype=tensor.dtype)
    return dataclasses.replace(entry, data=tensor)


def _tensor_entries(raw: dict) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {k: v for k, v in raw.items() if not isinstance(v, ShardedObject)}


def _return_freed_memory() -> None:
    """Make glibc give every large freed buffer back to the OS. By default it raises its mmap
    threshold to the largest buffer freed so far, after which tensors of a few MB come from the
    heap and stay in the process when freed: measured, the footprint grew by each tensor written
    until it neared the model's size. A fixed threshold (1 MiB) keeps it near one unit."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _check_out(out: Path) -> None:
    """Before anything is read: ``--out`` is new or an empty directory, in a place this process can write."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is not empty" if out.is_dir() else "is a file"
        raise FileExistsError(f"{out} exists and {what}; remove it or choose another --out")
    where = next(p for p in out.absolute().parents if p.exists())  # where out and its .tmp sibling are made
    if not where.is_dir():
        raise NotADirectoryError(f"--out {out}: {where} is a file, so no directory can be made under it; choose "
                                 "another --out")
    if not os.access(where, os.W_OK | os.X_OK):
        raise PermissionError(f"--out {out}: this user cannot write in {where} (the converter writes {out} and a "
                              f"sibling {out.name}.tmp there); choose another --out")


def _fresh_tmp(out: Path) -> Path:
    _check_out(out)
    return staging_dir(out)


def hf_to_mcore(hf_dir: str | Path, out: str | Path, layout: dict | None = None, dtype: torch.dtype | None = None,
                dry_run: bool = False, log: Callable[[str], None] = print) -> dict:
    """Convert an HF checkpoint into a megatron dist checkpoint; returns the plan's summary."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    hf_dir, out = Path(hf_dir), Path(out)
    if not dry_run:
        _check_out(out)
    cfg = read_hf_config(hf_dir, "--hf")
    layout = {"tp": 1, "pp": 1, "ep": 1, "etp": 0, "vpp": 1, **(layout or {})}
    check_model_layout(cfg, **layout, flags=True)
    src = HFCheckpoint(hf_dir)
    # Plan: the megatron tensors the HF headers convert to (meta tensors: names, shapes, dtypes).
    by_group: dict[tuple, list[str]] = {}
    for name in src.entries:
        by_group.setdefault(group_of(name), []).append(name)
    meta_full = {}
    for names in by_group.values():
        meta_full.update(hf_to_megatron({n: src.meta(n) for n in names}, cfg))
    raw = skeleton_state(cfg)
    tensors = _tensor_entries(raw)
    missing = sorted(set(tensors) - set(meta_full))
    if missing:
        raise KeyError(f"{hf_dir}: the checkpoint has no tensors for {missing[:5]} ({len(missing)} missing)")
    for name, entry in tensors.items():
        want = tuple(entry.data.shape)
        if tuple(meta_full[name].shape) != want:
            raise ValueError(f"{hf_dir}: {name} converts to shape {tuple(meta_full[name].shape)}; "
                             f"config.json implies {want}")
    items, where, total = [], {}, 0
    for name, entry in sorted(tensors.items(), key=lambda kv: group_of(kv[0])):  # unit by unit
        store = dtype or meta_full[name].dtype
        for st in _shard_list({name: entry}):
            offsets = torch.Size(st.global_offset)
            sizes = torch.Size((1,) * st.prepend_axis_num + tuple(st.local_shape))
            items.append(WriteItem(index=MetadataIndex(st.key, offsets), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, sizes),
                                                               properties=TensorProperties(dtype=store),
                                                               size=torch.Size(st.global_shape))))
            where[(st.key, tuple(offsets))] = (group_of(name), store)
            total += nbytes(sizes, store)
    objects = {v.unique_key: v for v in raw.values() if isinstance(v, ShardedObject)}
    items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in objects]
    summary = {"tensors": len(meta_full), "chunks": len(where), "bytes": total, "layout": layout}
    if dry_run:
        for name in sorted(tensors, key=lambda n: (group_of(n), n)):
            t = meta_full[name]
            log(f"{name}  {tuple(t.shape)}  {dtype or t.dtype}  {nbytes(t.shape, dtype or t.dtype)} B  -> __0_0.distcp")
        log(f"plan: {len(meta_full)} tensors, {total} bytes in one unsharded dist checkpoint {out} "
            f"(loads at any layout; checked for {layout})")
        return summary
    tmp = _fresh_tmp(out)
    _return_freed_memory()
    bar = _progress(total, "hf→mcore")
    cache: dict = {"group": None, "chunks": {}}

    def load_group(g: tuple) -> dict:
        full = hf_to_megatron({n: src.read(n) for n in by_group[g]}, cfg)
        real = {n: _with_data(e, full[n]) for n, e in tensors.items() if group_of(n) == g}
        return {(st.key, tuple(st.global_offset)): st.data for st in _shard_list(real)}

    def resolve(item):
        if item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save([objects[item.index.fqn].data], buf)
            return buf
        key = (item.index.fqn, tuple(item.index.offset))
        g, store = where[key]
        if cache["group"] != g:
            cache["group"], cache["chunks"] = None, {}  # free the previous unit first
            cache["chunks"], cache["group"] = load_group(g), g
        t = cache["chunks"].pop(key).to(store).reshape(item.tensor_data.chunk.sizes).contiguous()
        bar.update(t.nbytes)
        return t

    try:
        _write_dcp(tmp, items, resolve)
        bar.close()
        (tmp / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                       "common_backend": "torch", "common_backend_version": 1}))
        torch.save({}, tmp / "common.pt")
        (tmp / "hf").mkdir()
        copy_aux_files(hf_dir, tmp / "hf")
        (tmp / CONVERSION_FILE).write_text(json.dumps({"from_hf": str(Path(hf_dir).resolve()), **summary,
                                                       "dtype": str(dtype) if dtype else "as HF"}, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, out)
    log(f"wrote {out}: {summary['tensors']} megatron tensors, {total} bytes")
    return summary


def _write_dcp(path: Path, items: list, resolve) -> None:
    """torch's checkpoint writer over a fixed list of write items, each resolved only when written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan

    class StreamingPlanner(DefaultSavePlanner):
        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            self.state_dict, self.storage_meta, self.is_coordinator, self.mappings = {}, storage_meta, True, {}

        def create_local_plan(self):
            self.plan = SavePlan(items, planner_data={})
            return self.plan

        def resolve_data(self, write_item):
            return resolve(write_item)

    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, thread_count=1, sync_files=False)
    planner = StreamingPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)


def _read_dcp(path: Path, requests: list) -> None:
    """Fill each (key, global offsets, chunk sizes, destination) of ``requests`` from the dist
    checkpoint at ``path``, whatever chunks (TP/PP/EP layout) it was saved in."""
    import torch.distributed.checkpoint as dcp

    planner = _region_planner()(requests)
    try:
        dcp.load({}, storage_reader=dcp.FileSystemReader(str(path)), planner=planner, no_dist=True)
    finally:
        planner.requests = []  # the destinations are the caller's; drop them here at once


def _region_planner():
    """A load planner that reads given regions of given keys into given tensors (built lazily:
    torch's checkpoint modules are imported only when converting)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class RegionPlanner(DefaultLoadPlanner):
        def __init__(self, requests: list) -> None:
            super().__init__()
            self.requests = requests

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

        def create_local_plan(self):
            items = []
            for i, (key, offsets, sizes, _) in enumerate(self.requests):
                chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                for item in create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk]):
                    items.append(dataclasses.replace(item, dest_index=MetadataIndex(key, chunk.offsets, i)))
            return LoadPlan(items)

        def resolve_tensor(self, read_item):
            t = self.requests[read_item.dest_index.index][3]
            for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                t = t.narrow(dim, start, length)
            return t

        def commit_tensor(self, read_item, tensor):
            pass  # read in place

    return RegionPlanner


def dist_checkpoint_dir(path: Path, log: Callable[[str], None] = print) -> Path:
    """The dist checkpoint ``path`` names: itself, a run's step dir's ``policy/``, or a run dir's latest one's."""
    if (path / "metadata.json").is_file():
        return path
    step = newest_step_dir(path) if (path / "checkpoints").is_dir() else path
    if step is not None and (step / "policy" / "metadata.json").is_file():
        log(f"--ckpt: {step / 'policy'} (the policy of the run checkpoint {step})")
        return step / "policy"
    raise FileNotFoundError(f"{path} is not a megatron dist checkpoint (no metadata.json), a run checkpoint step dir "
                            "(run_dir/checkpoints/step_N with policy/) or a run dir (checkpoints/latest)")


def mcore_to_hf(ckpt: str | Path, out: str | Path, hf_config: str | Path | None = None,
                dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30, dry_run: bool = False,
                log: Callable[[str], None] = print) -> dict:
    """Convert a megatron dist checkpoint (converted, or a run's at any layout) into HF safetensors."""
    ckpt, out = dist_checkpoint_dir(Path(ckpt), log), Path(out)
    if not dry_run:
        _check_out(out)
    if hf_config:
        hf_config = Path(hf_config)
    elif (ckpt / "hf" / "config.json").is_file():  # a converted checkpoint carries its model's files
        hf_config = ckpt / "hf"
    else:  # a run's checkpoint: the model its run started from, as the run's config.json records it
        source, hf_config = recorded_source(ckpt)
        if hf_config is None:
            raise FileNotFoundError(f"{ckpt} carries no hf/config.json and {source}: pass "
                                    "--hf-config DIR (the HF model the run started from: its config and tokenizer)")
        log(f"--hf-config: {hf_config} ({source})")
    if not (hf_config / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {hf_config}: pass --hf-config DIR "
                                "(the HF model the run started from)")
    cfg = read_hf_config(hf_config, "--hf-config")
    check_same_model(ckpt, cfg, f"--hf-config {hf_config}")  # names both models (ValueError)
    saved = saved_tensors(ckpt)
    raw = _tensor_entries(skeleton_state(cfg))
    for st in _shard_list(raw):
        have = saved.get(st.key)
        if have is None:
            raise KeyError(f"{ckpt}: no tensor {st.key} (is {hf_config}/config.json the model of this checkpoint?)")
        if tuple(have.size) != tuple(st.global_shape):
            raise ValueError(f"{ckpt}: {st.key} has shape {tuple(have.size)}; {hf_config}/config.json "
                             f"implies {tuple(st.global_shape)}")
    dropped = sorted(set(model_tensor_shapes(ckpt)) - {st.key for st in _shard_list(raw)})
    if any(".lora." in k for k in dropped):
        raise ValueError(f"{ckpt}: a LoRA run's checkpoint ({sum('.lora.' in k for k in dropped)} adapter tensors): "
                         "its base alone would be converted; the run exports its adapters at run_dir/hf/step_N "
                         "(a PEFT adapter) — merge one into the base with tools/merge_lora.py")
    if dropped:
        raise ValueError(f"{ckpt}: {len(dropped)} tensor(s) have no place in the model of {hf_config}/config.json "
                         f"and would be dropped: {', '.join(dropped)} (is it the model of this checkpoint?)")
    stored = {name: saved[e.key].properties.dtype for name, e in raw.items()}
    meta = {name: torch.empty(e.data.shape, dtype=dtype or stored[name], device="meta") for name, e in raw.items()}
    groups = sorted({group_of(n) for n in raw}, key=lambda g: (g == GLOBAL, g))  # layers, then the rest
    plan = [(n, tuple(t.shape), t.dtype) for g in groups
            for n, t in megatron_to_hf(sorted((k, v) for k, v in meta.items() if group_of(k) == g), cfg)]
    writer = ShardedWriter(out, plan, max_shard_bytes)
    summary = {"tensors": len(plan), "bytes": writer.total, "files": writer.files}
    if dry_run:
        for name, shape, dt in plan:
            log(f"{name}  {shape}  {dt}  {nbytes(shape, dt)} B  -> {writer.files[writer.shard_of[name]]}")
        log(f"plan: {len(plan)} tensors, {writer.total} bytes in {len(writer.files)} file(s) under {out}")
        return summary
    tmp = _fresh_tmp(out)
    _return_freed_memory()
    writer.out = tmp
    bar = _progress(writer.total, "mcore→hf")
    try:
        for g in groups:
            loaded = {n: torch.empty(e.data.shape, dtype=stored[n]) for n, e in raw.items() if group_of(n) == g}
            request = {n: _with_data(e, loaded[n]) for n, e in raw.items() if group_of(n) == g}
            _read_dcp(ckpt, [(st.key, st.global_offset, (1,) * st.prepend_axis_num + tuple(st.local_shape),
                              st.data.view((1,) * st.prepend_axis_num + tuple(st.local_shape)))
                             for st in _shard_list(request)])
            for name, t in megatron_to_hf(sorted(loaded.items()), cfg):
                t = t.to(dtype) if dtype else t
                writer.add(name, t)
                bar.update(t.nbytes)
            del loaded, request
        writer.finish()
        bar.close()
        copy_aux_files(hf_config, tmp)
        written = {d for _, _, d in plan}
        if len(written) == 1:  # the config says what the weights are
            _set_config_dtype(tmp / "config.json", written.pop())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, out)
    log(f"wrote {out}: {len(plan)} HF tensors, {writer.total} bytes in {len(writer.files)} file(s)")
    return summary


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    cfg = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    for key in ("torch_dtype", "dtype"):
        if key in cfg or key == "dtype":
            cfg[key] = name
    path.write_text(json.dumps(cfg, indent=2) + "\n")
