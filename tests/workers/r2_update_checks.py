"""R2 (``algo.routing_replay: trainer``) in one RL update with a proximal policy (``algo.decoupled_ppo``): the
recording pass's logprobs are the proximal ones, not a second forward with the same routes.

    python tests/workers/r2_update_checks.py MODEL_DIR

A policy trainer (one process) on a fixed batch: the recording pass's logprobs against a pass replaying the
recorded routes; then ``rl_update`` on groups of the same samples, counting the trainer's forward passes
(``PolicyTrainer._run``: forward-only passes and optimizer steps' forward-backward passes). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers.scripts import ROOT  # noqa: E402
from helpers.trainers import build_trainer, fixed_batch  # noqa: E402


def main(model_dir: str) -> None:
    from megarl.config.loader import load_config
    from megarl.config.schema import OptimConfig
    from megarl.trainer.rl_update import Learners, rl_update
    from megarl.types import Group, Sample

    _, hf, trainer = build_trainer("single", model_dir, OptimConfig(lr=1e-3, micro_batch_size=4))
    trainer.routing_replay = "trainer"
    batch = fixed_batch(hf["vocab_size"])
    routes, recording = trainer.record_routes(batch)
    batch.routes = routes
    replayed = trainer.logprobs(batch)
    passes = []
    run = trainer._run

    def counted(b, loss_fn, forward_only):
        passes.append("forward" if forward_only else "train")
        return run(b, loss_fn, forward_only)

    trainer._run = counted
    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", ["algo.routing_replay=trainer", "algo.decoupled_ppo=true",
                                                           "algo.minibatches=2", "algo.ppo_epochs=1"])
    g = torch.Generator().manual_seed(3)
    groups = [Group(i, "", "", [Sample(prompt_ids=torch.randint(2, hf["vocab_size"], (5,), generator=g).tolist(),
                                       response_ids=torch.randint(2, hf["vocab_size"], (6 + j,), generator=g).tolist(),
                                       logprobs=[-2.5] * (6 + j), reward=float(j % 2), finish_reason="stop")
                                for j in range(2)]) for i in range(4)]
    metrics = rl_update(Learners(trainer), groups, cfg, pad_id=0, step=1)
    print(json.dumps({"recording_vs_replayed_max": float(((recording - replayed) * batch.loss_mask).abs().max()),
                      "passes": passes, "loss": metrics.get("loss/policy"),
                      "mismatch_keys": sorted(k for k in metrics if k.startswith("mismatch/"))}))


if __name__ == "__main__":
    main(sys.argv[1])
