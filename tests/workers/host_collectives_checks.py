"""The default group's host-tensor collectives on a GPU machine (two processes, one GPU is enough: NCCL is never
asked to run): ``collectives.any_rank`` each step, with and without its timeout, and a float64 host all-reduce as the
routing statistics run. Over the group megarl starts with GPUs (``process_group_backend``); with ``nccl`` alone
(argv ``nccl``) the first one raises.

Usage: python -m torch.distributed.run --standalone --nproc-per-node 2 tests/workers/host_collectives_checks.py
       [nccl]   (rank 0 prints one JSON line)
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist


def main(only_nccl: bool) -> None:
    from megarl.distributed.bootstrap import init_distributed
    from megarl.distributed.collectives import any_rank
    from megarl.distributed.parallel import init_process_group

    init_distributed()  # (sets this rank's GPU)
    if only_nccl:
        dist.init_process_group(backend="nccl")
    rank, world = init_process_group()
    out = {"world": world, "backend": str(dist.get_backend()), "cuda": torch.cuda.is_available()}
    try:
        out["any_rank"] = [any_rank(rank == 1), any_rank(False), any_rank(rank == 0, timeout_s=60.0)]
        totals = torch.tensor([float(rank), 1.0], dtype=torch.float64)
        dist.all_reduce(totals)
        out["host_sum"] = totals.tolist()
        probe = torch.ones(1, device="cuda") if torch.cuda.device_count() >= world else None  # (NCCL: a GPU a rank)
        if probe is not None:
            dist.all_reduce(probe)
            out["cuda_sum"] = probe.item()
    except RuntimeError as exc:
        out["error"] = str(exc).splitlines()[0]
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:] == ["nccl"])
