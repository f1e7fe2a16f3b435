"""A converted checkpoint in the trainer at one layout, and that layout's own checkpoint back out.

    torchrun --nproc-per-node 2 tests/workers/conversion_checks.py LAYOUT OTHER_MODEL CKPT WORK

Builds the trainer at LAYOUT from OTHER_MODEL (same config, different weights, so that only a real
load can give the right answer), loads the converted dist checkpoint CKPT (model only), writes
the trainer's logprobs of a fixed batch to WORK/logprobs.pt, and saves the trainer's own dist
checkpoint at this layout to WORK/ckpt (for mcore-to-hf).
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main(layout: str, model_dir: str, ckpt: str, work: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
    from helpers import trainers
    from helpers.trainers import build_trainer, fixed_batch
    from megarl.checkpoint.dist import load_checkpoint, save_checkpoint
    from megarl.config.schema import OptimConfig

    trainers.LAYOUTS.update({"tp2_pp2": dict(tp=2, pp=2), "tp2_sp_pp2": dict(tp=2, pp=2, sequence_parallel=True)})
    # (a never-stepped distributed optimizer cannot be saved on megatron-core 0.16.1: plain Adam here)
    ps, cfg, trainer = build_trainer(layout, model_dir, OptimConfig(micro_batch_size=4, distributed_optimizer=False))
    load_checkpoint(trainer, ckpt, load_optimizer=False)
    logprobs = trainer.logprobs(fixed_batch(cfg["vocab_size"], seq=40))
    save_checkpoint(trainer, os.path.join(work, "ckpt"))
    if ps.rank == 0:
        torch.save(logprobs, os.path.join(work, "logprobs.pt"))
        print(json.dumps({"ok": True, "layout": layout, "world": ps.world_size}), flush=True)


if __name__ == "__main__":  # the dist-checkpoint writer re-imports this script: keep the guard
    main(*sys.argv[1:])
    from helpers.processes import end_process_group  # (tests/ is on the worker's path)
    end_process_group()  # gloo ended before the interpreter's teardown
