"""Dist checkpoint resharding: save at one layout, resume at another, compare the next step.

    torchrun --nproc-per-node 2 tests/workers/checkpoint_checks.py save tp2 MODEL_DIR WORK
    python tests/workers/checkpoint_checks.py load single MODEL_DIR WORK

``save`` takes one PPO step (``save_unstepped``: none), saves model + optimizer to WORK/ckpt, takes a second step and
writes the full weights after it to WORK/expected.pt. ``load`` builds the trainer fresh from
the HF weights, loads WORK/ckpt, takes the same second step and writes WORK/got.pt. Equal
weights after the second step need the Adam moments to have survived the reshard.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main(action: str, layout: str, model_dir: str, work: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
    from helpers.processes import end_process_group
    from helpers.trainers import build_trainer, fixed_batch
    from megarl.algo.losses import ppo_clip_loss
    from megarl.checkpoint.dist import load_checkpoint, save_checkpoint
    from megarl.config.schema import OptimConfig
    from megarl.models.hf_config import num_experts
    from megarl.weight_sync.gather import gather_full_megatron

    ps, cfg, trainer = build_trainer(layout, model_dir, OptimConfig(lr=1e-3, micro_batch_size=2, grad_clip=0.0))
    batch = fixed_batch(cfg["vocab_size"])

    def loss(lp, mb):
        return ppo_clip_loss(lp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"], 0.2, 0.28)

    ckpt = os.path.join(work, "ckpt")
    if action in ("save", "save_unstepped"):  # unstepped: saved before any optimizer step (no Adam state)
        if action == "save":
            trainer.train_step(batch, loss)
        else:  # weights moved without this optimizer (as a supervised warm-up may): the loader must take them
            gen = torch.Generator().manual_seed(11)
            with torch.no_grad():
                for m in trainer.modules:
                    for prm in m.parameters():
                        prm.add_(torch.randn(prm.shape, generator=gen) * 0.01)
        save_checkpoint(trainer, ckpt)
    else:
        load_checkpoint(trainer, ckpt)
    trainer.train_step(batch, loss)
    full = gather_full_megatron(trainer.modules, ps, cfg["num_hidden_layers"], num_experts(cfg))
    if ps.rank == 0:
        torch.save(full, os.path.join(work, "got.pt" if action == "load" else "expected.pt"))
        print(json.dumps({"ok": True, "action": action, "layout": layout}), flush=True)
    end_process_group()


if __name__ == "__main__":  # the dist-checkpoint writer re-imports this script: keep the guard
    main(*sys.argv[1:])
