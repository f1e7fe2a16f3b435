#!/usr/bin/env python
"""Merge a PEFT LoRA adapter into its base model: a full HF checkpoint, sharded as the base is.

    # a LoRA run's export (run_dir/hf/step_N: adapter_config.json + adapter_model.safetensors) into its base
    python tools/merge_lora.py --adapter runs/x/hf/step_100 --out models/x-merged
    # another copy of the base than the one adapter_config.json names (base_model_name_or_path)
    python tools/merge_lora.py --adapter runs/x/hf/step_100 --out models/x-merged --base /models/Qwen3-8B

Routed experts' adapters in PEFT's fused layout (``target_parameters``: one pair per layer for every expert) merge
into each expert's weights, as HF checkpoints store them (``model.layers.<i>.mlp.experts.<e>.gate_proj.weight``).
Each adapted weight becomes ``W + scale · B @ A`` (``scale`` = lora_alpha / r; lora_alpha / √r with use_rslora),
computed in fp32 and stored in the base tensor's dtype. The base is read one safetensors shard at a time and each
shard written with its weights merged, under the same file name, before the next is read (peak memory: about one
shard, never the model); the index, config, generation config and tokenizer files are copied from the base. Every
check comes first — the files are there, every adapted module is a weight of the base with the adapter's shapes, the
adapter's rank is the config's — and a failure names the file or tensor (exit status 2, nothing written). Output
goes to OUT.tmp and is renamed to OUT when complete.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
from pathlib import Path

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# PEFT's saved names: base_model.model.<module>.lora_A.weight (an adapter name before .weight in some versions)
LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[\w-]+)?\.weight$")
UNSUPPORTED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)"}


class MergeError(ValueError):
    """Bad input, named (the tool's exit status 2)."""


def read_adapter(adapter: Path) -> tuple[dict, dict[str, tuple]]:
    """adapter_config.json and the adapter's tensors: module name → (A, B, scale), every rank checked."""
    from safetensors.torch import load_file

    config_file, weights_file = adapter / ADAPTER_CONFIG, adapter / ADAPTER_WEIGHTS
    for f in (config_file, weights_file):
        if not f.is_file():
            other = sorted(p.name for p in adapter.glob("adapter_model.*")) if adapter.is_dir() else []
            hint = f" (it holds {', '.join(other)}: only safetensors is read)" if other and f == weights_file else ""
            raise MergeError(f"--adapter {adapter}: no {f.name}{hint}")
    try:
        cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise MergeError(f"{config_file}: not JSON ({exc})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise MergeError(f"{config_file}: peft_type {cfg['peft_type']!r}; only LORA adapters merge")
    for key, what in UNSUPPORTED.items():
        if cfg.get(key):
            raise MergeError(f"{config_file}: {key} is set; {what} adapters are not merged by this tool")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if cfg.get(key):
            raise MergeError(f"{config_file}: {key} is set; only one rank and alpha for every module is merged")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or cfg[key] <= 0:
            raise MergeError(f"{config_file}: {key} must be a number > 0, got {cfg.get(key)!r}")
    rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    tensors = load_file(str(weights_file))
    if cfg.get("target_parameters"):  # routed experts in PEFT's fused layout: per expert, as the base stores them
        from megarl.models.peft_experts import TARGET_PARAMETERS, split_experts

        if not set(cfg["target_parameters"]) <= set(TARGET_PARAMETERS):
            raise MergeError(f"{config_file}: target_parameters {cfg['target_parameters']}; only "
                             f"{TARGET_PARAMETERS} (fused MoE experts) merge")
        try:
            tensors = split_experts(tensors, rank)
        except ValueError as exc:
            raise MergeError(f"{weights_file}: {exc}") from None
    pairs: dict[str, dict[str, object]] = {}
    for key, t in tensors.items():
        m = LORA_KEY.match(key)
        if m is None:
            raise MergeError(f"{weights_file}: tensor {key} is not a LoRA A or B of a linear layer "
                             "(base_model.model.<module>.lora_A.weight / lora_B.weight)")
        if t.dim() != 2:
            raise MergeError(f"{weights_file}: tensor {key} has shape {list(t.shape)}, not a matrix")
        pairs.setdefault(m["module"], {})[m["which"]] = t
    if not pairs:
        raise MergeError(f"{weights_file}: no LoRA tensors")
    out = {}
    for module, ab in sorted(pairs.items()):
        for which in "AB":
            if which not in ab:
                raise MergeError(f"{weights_file}: base_model.model.{module}.lora_{'AB'.replace(which, '')}.weight "
                                 f"has no lora_{which} beside it")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise MergeError(f"{weights_file}: {module}: lora_A {list(a.shape)}, lora_B {list(b.shape)} are of rank "
                             f"{a.shape[0]} / {b.shape[1]}; {config_file.name} says r = {rank}")
        out[module] = (a, b, scale)
    return cfg, out


def weight_map(base: Path) -> tuple[dict[str, str], dict[str, tuple]]:
    """The base's tensors: name → shard file, and name → (dtype, shape), from the index and headers only."""
    from megarl.models.hf_config import is_dist_checkpoint
    from megarl.models.hf_reader import INDEX, HFCheckpoint

    if not base.is_dir():
        raise MergeError(f"--base {base}: not a directory")
    if is_dist_checkpoint(base.parent) and not any(base.glob("*.safetensors")):
        raise MergeError(f"--base {base} is a megatron dist checkpoint's hf/ (config and tokenizer, no weights): "
                         f"convert the checkpoint (python tools/convert_checkpoint.py mcore-to-hf --ckpt {base.parent} "
                         "--out DIR) and pass --base DIR")
    try:
        ckpt = HFCheckpoint(base)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        raise MergeError(f"--base {base}: {exc}") from None
    files = {name: entry[0].name for name, entry in ckpt.entries.items()}
    if not (base / INDEX).is_file() and len(set(files.values())) > 1:
        raise MergeError(f"--base {base}: {len(set(files.values()))} safetensors files and no {INDEX}")
    return files, {name: (entry[1], entry[2]) for name, entry in ckpt.entries.items()}


def plan(adapters: dict[str, tuple], files: dict[str, str], meta: dict[str, tuple],
         base: Path) -> dict[str, dict[str, tuple]]:
    """Shard file → {base weight name: (A, B, scale)}; each adapted module checked against the base."""
    by_file: dict[str, dict[str, tuple]] = {}
    for module, (a, b, scale) in adapters.items():
        weight = f"{module}.weight"
        if weight not in files:
            raise MergeError(f"the adapter's module {module} has no weight in --base {base} (no tensor {weight}): "
                             "an adapter of another model?")
        dtype, shape = meta[weight]
        if tuple(shape) != (b.shape[0], a.shape[1]):
            raise MergeError(f"{weight}: the base's is {list(shape)}, the adapter's B @ A is "
                             f"{[b.shape[0], a.shape[1]]}: an adapter of another model?")
        if not dtype.is_floating_point:
            raise MergeError(f"{weight}: the base's is {dtype}, not a floating-point weight")
        by_file.setdefault(files[weight], {})[weight] = (a, b, scale)
    return by_file


def merge(adapter: Path, out: Path, base: Path | None = None) -> dict:
    """Check everything, then write the merged checkpoint at ``out`` shard by shard; returns a summary."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megarl.convert.hf_files import copy_aux_files, publish, staging_dir
    from megarl.models.hf_reader import INDEX

    cfg, adapters = read_adapter(adapter)
    if base is None:
        if not cfg.get("base_model_name_or_path"):
            raise MergeError(f"{adapter / ADAPTER_CONFIG} names no base_model_name_or_path: pass --base")
        base = Path(cfg["base_model_name_or_path"])
        if not base.is_dir():
            raise MergeError(f"{adapter / ADAPTER_CONFIG}: base_model_name_or_path {base} is not a local "
                             "directory: pass --base")
    if out.exists():
        raise MergeError(f"--out {out} exists: name a new directory")
    if out.resolve() in (base.resolve(), adapter.resolve()):
        raise MergeError(f"--out {out} is the base or the adapter directory")
    files, meta = weight_map(base)
    by_file = plan(adapters, files, meta, base)
    tmp = staging_dir(out)
    try:
        for name in sorted(set(files.values())):  # one shard in memory at a time
            with safe_open(str(base / name), "pt") as f:
                metadata = f.metadata()
                tensors = {key: f.get_tensor(key) for key in f.keys()}
            for weight, (a, b, scale) in by_file.get(name, {}).items():
                w = tensors[weight]
                tensors[weight] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
            save_file(tensors, str(tmp / name), metadata=metadata)
            del tensors
        if (base / INDEX).is_file():
            shutil.copy2(base / INDEX, tmp / INDEX)
        copy_aux_files(base, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, out)
    return {"base": str(base), "out": str(out), "merged": sum(len(m) for m in by_file.values()),
            "shards": len(set(files.values())), "rank": int(cfg["r"]), "alpha": cfg["lora_alpha"],
            "dtype": sorted({str(meta[w][0]).removeprefix("torch.") for m in by_file.values() for w in m})}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", required=True, help="PEFT adapter directory (adapter_config.json + "
                        "adapter_model.safetensors), e.g. a LoRA run's run_dir/hf/step_N")
    parser.add_argument("--out", required=True, help="output directory (must not exist)")
    parser.add_argument("--base", default=None, help="base HF checkpoint directory (default: adapter_config.json's "
                        "base_model_name_or_path)")
    args = parser.parse_args(argv)
    try:
        summary = merge(Path(args.adapter), Path(args.out), Path(args.base) if args.base else None)
    except MergeError as exc:
        print(f"merge_lora: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    print(f"merge_lora: merged {summary['merged']} weights (r {summary['rank']}, alpha {summary['alpha']:g}) into "
          f"{summary['shards']} shard(s): {summary['out']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
