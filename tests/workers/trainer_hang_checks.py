"""A trainer collective that never returns, under the hang watchdog (``distributed/watchdog.py``).

    MEGARL_TEST_FAULT=optimizer_hang@2 torchrun --nproc-per-node 2 tests/workers/trainer_hang_checks.py MODEL_DIR

A data-parallel policy trainer with the optimizer step's fault hooks (``testing/faults.py``) takes a step of RL
step 1 (returns in time: nothing fires), then one of RL step 2, where the last rank blocks forever after its
backward and rank 0 waits for it in the step's non-finite check (an all-reduce). Rank 0's watchdog (2 s) must end
the process with 75; the hung rank's own (60 s) would fire later, after torchrun has ended it.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers.trainers import build_trainer, fixed_batch  # noqa: E402


def main(model_dir: str) -> None:
    import logging

    import torch.distributed as dist

    from megarl.algo.objective import policy_loss_fn
    from megarl.config.schema import AlgoConfig, OptimConfig
    from megarl.distributed import watchdog
    from megarl.testing.faults import faulty_optimizer_steps

    _, cfg, trainer = build_trainer("dp2", model_dir, OptimConfig(lr=1e-3, micro_batch_size=4))
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the fault hook's line
    watchdog.start(timeout_s=2.0 if rank == 0 else 60.0, status=75, rank=rank)
    faulty_optimizer_steps(trainer)
    batch, loss = fixed_batch(cfg["vocab_size"]), policy_loss_fn(AlgoConfig())
    for step in (1, 2):
        watchdog.note_rl_step(step)
        trainer.train_step(batch, loss)
        print(f"rank {rank}: RL step {step}'s optimizer step returned", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
