"""``model.path`` set to a converted dist checkpoint: the trainer it builds holds the HF directory's weights.

    torchrun --nproc-per-node 2 tests/workers/start_from_dist_checks.py LAYOUT HF_DIR CKPT

Builds the policy at LAYOUT from HF_DIR and again from CKPT (``tools/convert_checkpoint.py hf-to-mcore``'s output of
HF_DIR, loaded by megatron's dist checkpointing, resharded to LAYOUT), and a critic from CKPT (its value head left
at zero, as from an HF directory); prints how many parameters each rank compared and which differ.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main(layout: str, hf_dir: str, ckpt: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
    import torch.distributed as dist

    from helpers.trainers import build_trainer
    from megarl.config.schema import OptimConfig

    optim = OptimConfig(micro_batch_size=4)
    ps, _, from_hf = build_trainer(layout, hf_dir, optim)
    _, _, from_dist = build_trainer(layout, ckpt, optim)
    _, _, critic = build_trainer(layout, ckpt, optim, head="value")
    want = dict(p for m in from_hf.modules for p in m.named_parameters())
    got = dict(p for m in from_dist.modules for p in m.named_parameters())
    differ = sorted(n for n in want if n not in got or not torch.equal(want[n], got[n]))
    trunk = {n: p for m in critic.modules for n, p in m.named_parameters() if not n.startswith("output_layer.")}
    differ += sorted(f"critic:{n}" for n, p in trunk.items() if not torch.equal(want[n], p))
    head = [p for m in critic.modules for n, p in m.named_parameters() if n.startswith("output_layer.")]
    reports = [None] * ps.world_size
    dist.all_gather_object(reports, {"compared": len(want) + len(trunk), "differ": differ,
                                     "head_zero": all(not p.any() for p in head), "heads": len(head)})
    if ps.rank == 0:
        print(json.dumps({"ok": True, "ranks": reports}), flush=True)


if __name__ == "__main__":  # megatron's checkpoint reader may re-import this script: keep the guard
    main(*sys.argv[1:])
    from helpers.processes import end_process_group  # (tests/ is on the worker's path)
    end_process_group()  # gloo ended before the interpreter's teardown
