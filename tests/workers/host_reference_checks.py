"""A host-resident KL reference (``trainer.reference_on_host``: ``rl_update.HostReference``) against a reference of
its own, at one layout (gloo, CPU): the policy trains a step (so the two models differ), then both references score
the same batch. Launched plainly (one process) or by torchrun (two).

    python tests/workers/host_reference_checks.py LAYOUT MODEL_DIR

Rank 0 prints one JSON line: the largest gap of the host reference's logprobs to the resident one's (0 when the
swap is right), how far they are from the policy's (> 0: the swap ran the reference's weights), and whether the
policy's weights and logprobs after the swap are bit for bit those before it.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers.processes import end_process_group  # noqa: E402
from helpers.trainers import LAYOUTS, fixed_batch, seeded_layout  # noqa: E402


def main(layout: str, model_dir: str) -> None:
    from megarl.algo.losses import ppo_clip_loss
    from megarl.config.schema import OptimConfig
    from megarl.trainer.policy import PolicyTrainer
    from megarl.trainer.rl_update import HostReference

    spec = dict(LAYOUTS[layout])
    spec.pop("rows", None)
    common = dict(precision=spec.pop("precision", "fp32"), moe_dispatcher=spec.pop("moe_dispatcher", "alltoall"),
                  packing=True)
    ps, cfg = seeded_layout(spec, model_dir)
    optim = OptimConfig(lr=3e-3, micro_batch_size=4)
    policy = PolicyTrainer(cfg, model_dir, ps, optim, **common)
    resident = PolicyTrainer(cfg, model_dir, ps, optim, trainable=False, **common)
    host = HostReference(policy, PolicyTrainer(cfg, model_dir, ps, optim, trainable=False, on_host=True, **common))
    batch = fixed_batch(cfg["vocab_size"])
    policy.train_step(batch, lambda lp, mb: ppo_clip_loss(lp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"],
                                                          0.2, 0.28))
    weights = [p.detach().clone() for m in policy.modules for p in m.parameters()]
    before = policy.logprobs(batch)
    mask = batch.loss_mask.bool()
    got, want = host.logprobs(batch), resident.logprobs(batch)
    after = policy.logprobs(batch)
    same = all(torch.equal(w, p) for w, p in zip(weights, (p for m in policy.modules for p in m.parameters())))
    out = {"reference_gap": float((got - want)[mask].abs().max()),
           "policy_gap": float((got - before)[mask].abs().max()),
           "weights_back": same, "logprobs_back": bool(torch.equal(before, after))}
    if ps.rank == 0:
        print(json.dumps(out), flush=True)
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
