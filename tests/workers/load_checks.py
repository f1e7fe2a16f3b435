"""The trainer's sharded load of an HF checkpoint on real megatron-core models (gloo, 2 processes).

    torchrun --nproc-per-node 2 tests/workers/load_checks.py memory:MODEL_DIR:LAYOUT exact:MODEL_DIR:LAYOUT[:bf16] ...

Each argument is one check, run in order; rank 0 prints one JSON line: every rank's result of each check, by its
argument. ``exact``: for a model and layout (``helpers.trainers.LAYOUTS``), this rank's model chunks are built and
loaded by ``load_hf_weights`` (slices read from the files; into bf16 parameters with ``:bf16``); every parameter must
equal, bit for bit, what the whole-file path (``helpers.hf_loading``) cut for it.

``memory``: the host memory the load adds on each rank (peak RSS during it minus RSS before it, the model already
built), for the sliced load and, on a second model built alike, for the whole-file path; with the checkpoint's
bytes. Run it with ``MALLOC_MMAP_THRESHOLD_=65536``: every large buffer is its own mapping, so RSS falls when one is
freed (glibc's default keeps freed memory in its heap, which would hide the second load's buffers from its peak).
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers


def build(model_dir: str, layout: str, dtype: torch.dtype = torch.float32):
    """Parallel state for ``layout``, the HF config and this rank's model chunks (not loaded)."""
    from megatron.core import parallel_state as mpu

    from helpers.trainers import LAYOUTS
    from megarl.compat.megatron import activate_cpu
    from megarl.distributed.parallel import build_parallel_state
    from megarl.models.hf_config import read_hf_config
    from megarl.trainer.model import build_gpt_model

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    spec = {k: v for k, v in LAYOUTS[layout].items() if k in ("tp", "pp", "ep", "etp", "vpp", "sequence_parallel")}
    ps = build_parallel_state(**spec)
    activate_cpu()
    cfg = read_hf_config(model_dir)
    return ps, cfg, lambda: [build_gpt_model(cfg, ps, vp, dtype=dtype) for vp in range(ps.vpp)]


def exact(model_dir: str, layout: str, precision: str = "fp32") -> dict:
    from helpers.hf_loading import whole_file_shards
    from megarl.trainer.model import load_hf_weights

    ps, cfg, make = build(model_dir, layout, torch.bfloat16 if precision == "bf16" else torch.float32)
    modules = make()
    load_hf_weights(modules, model_dir, cfg, ps)
    checked, wrong, dtypes = 0, [], set()
    for vp, model in enumerate(modules):
        want = whole_file_shards(model_dir, cfg, ps.coords(vp))
        for name, p in model.named_parameters():
            checked += 1
            dtypes.add(str(p.dtype).removeprefix("torch."))
            if name not in want or not torch.equal(p.detach(), want[name].to(p.dtype)):
                wrong.append(name)
    return {"checked": checked, "wrong": wrong[:5], "dtypes": sorted(dtypes),
            "coords": [str(ps.coords(vp)) for vp in range(ps.vpp)]}


def memory(model_dir: str, layout: str) -> dict:
    from helpers.hf_loading import peak_rss_added, whole_file_load
    from megarl.models.hf_reader import HFCheckpoint
    from megarl.trainer.model import load_hf_weights

    ps, cfg, make = build(model_dir, layout)
    files = HFCheckpoint(model_dir)
    sliced_modules = make()
    sliced = peak_rss_added(lambda: load_hf_weights(sliced_modules, model_dir, cfg, ps))
    dist.barrier()
    gc.collect()
    whole_modules = make()
    whole = peak_rss_added(lambda: whole_file_load(whole_modules, model_dir, cfg, ps))
    same = all(torch.equal(a, b) for m, n in zip(sliced_modules, whole_modules)
               for a, b in zip(m.parameters(), n.parameters()))
    return {"sliced": sliced, "whole": whole, "same": same,
            "shard_bytes": sum(p.numel() * p.element_size() for m in sliced_modules for p in m.parameters()),
            "checkpoint_bytes": sum(nbytes for _, _, _, _, nbytes in files.entries.values()),
            "files": len({f for f, *_ in files.entries.values()})}


if __name__ == "__main__":
    from helpers.processes import end_process_group
    from megarl.distributed.parallel import init_process_group

    init_process_group()
    results = {}
    for check in sys.argv[1:]:
        what, *args = check.split(":")
        mine = {"exact": exact, "memory": memory}[what](*args)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        results[check] = every
        gc.collect()
    if dist.get_rank() == 0:
        print(json.dumps(results), flush=True)
    end_process_group()
