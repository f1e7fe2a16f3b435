"""LoRA adapters in a run's dist checkpoint: save at one layout, resume at another, compare the next step (gloo, CPU,
fp32). Launched by the tests with torchrun (2 processes) or plainly (1).

    python tests/workers/lora_checkpoint_checks.py ACTION LAYOUT MODEL_DIR WORK [TARGETS]

``save``: a trainer with adapters (rank 4 on every target) takes one PPO step, saves model + optimizer to WORK/ckpt,
takes a second step and writes WORK/expected.pt. ``load``: a fresh trainer at LAYOUT loads WORK/ckpt, takes the same
second step and writes WORK/got.pt. Each holds, gathered into one process's layout (by global name: TP shards joined,
pipeline and virtual stages and EP ranks' experts merged): the adapters as saved or loaded (``at_save``), the second
step's loss and adapter gradients (reduced over DP), and the adapters after it (equal only if Adam's moments came
back). ``roundtrip`` (one process):
both in one interpreter, then the refusals, each error's text under ``errors``: the checkpoint with adapters loaded by
a trainer without them, and (with and without the optimizer) by one of another rank, alpha or targets, as a run's base
weights (``load_model_weights``), and a checkpoint without adapters loaded by a trainer with them.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers.lora_grads import adapter_params, merged, reduced_everywhere, whole  # noqa: E402
from helpers.processes import end_process_group  # noqa: E402
from helpers.trainers import LAYOUTS, fixed_batch, seeded_layout  # noqa: E402


def trainer_at(ps, cfg, model_dir: str, rank: int = 4, alpha: float = 8.0, targets: str = "",
               dispatcher: str = "alltoall"):
    from megarl.config.schema import LoraConfig, OptimConfig
    from megarl.trainer.policy import PolicyTrainer

    optim = OptimConfig(lr=1e-3, micro_batch_size=2, grad_clip=0.0, logprob_chunk=8)
    lora = LoraConfig(rank=rank, alpha=alpha, **({"targets": targets} if targets else {}))  # (default: every target)
    return PolicyTrainer(cfg, model_dir, ps, optim, lora=lora if rank else None, packing=True,
                         moe_dispatcher=dispatcher)


def gathered(trainer, ps, grads: bool = False) -> dict:
    """Every adapter tensor (or its gradient) as one process holds it, by global name: TP shards joined, every
    pipeline stage's (and virtual stage's) and EP rank's merged."""
    return merged({full: whole(name, (p.main_grad if grads else p).detach().clone(), adapter, ps)
                   for full, name, p, adapter in adapter_params(trainer)}, ps)


def step(trainer, batch) -> float:
    from megarl.algo.losses import ppo_clip_loss

    return trainer.train_step(batch, lambda lp, mb: ppo_clip_loss(lp, mb["old_logprobs"], mb["advantages"],
                                                                   mb["loss_mask"], 0.2, 0.28))["loss"]


def next_step(trainer, ps, batch) -> dict:
    """The adapters as they are (as saved, or as loaded) and the second step from there."""
    out = {"at_save": gathered(trainer, ps), "loss": step(trainer, batch)}
    reduced_everywhere(trainer)  # (the distributed optimizer left each DP rank its own shard reduced)
    return {**out, "grads": gathered(trainer, ps, grads=True), "after": gathered(trainer, ps)}


def refusal(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


def main(action: str, layout: str, model_dir: str, work: str, targets: str = "") -> None:
    from functools import partial

    from megarl.checkpoint.dist import load_checkpoint, save_checkpoint

    spec = dict(LAYOUTS[layout])
    build = partial(trainer_at, targets=targets, dispatcher=spec.pop("moe_dispatcher", "alltoall"))
    ps, cfg = seeded_layout(spec, model_dir)
    batch = fixed_batch(cfg["vocab_size"])
    ckpt = os.path.join(work, "ckpt")
    results = {}
    if action in ("save", "roundtrip"):
        trainer = build(ps, cfg, model_dir)
        step(trainer, batch)
        save_checkpoint(trainer, ckpt)
        results["expected"] = next_step(trainer, ps, batch)
    if action in ("load", "roundtrip"):
        trainer = build(ps, cfg, model_dir)
        load_checkpoint(trainer, ckpt)
        results["got"] = next_step(trainer, ps, batch)
    if action == "roundtrip":
        from megarl.checkpoint.dist import load_model_weights

        plain = trainer_at(ps, cfg, model_dir, rank=0)
        errors = {"no_lora_here": refusal(lambda: load_checkpoint(plain, ckpt)),
                  "no_lora_here_weights_only": refusal(lambda: load_checkpoint(plain, ckpt, load_optimizer=False)),
                  "as_base_weights": refusal(lambda: load_model_weights(plain.modules, ckpt))}
        other_rank, other_alpha = trainer_at(ps, cfg, model_dir, rank=2), trainer_at(ps, cfg, model_dir, alpha=16.0)
        errors["other_rank"] = refusal(lambda: load_checkpoint(other_rank, ckpt))
        errors["other_alpha"] = refusal(lambda: load_checkpoint(other_alpha, ckpt, load_optimizer=False))
        errors["other_targets"] = refusal(lambda: load_checkpoint(trainer_at(ps, cfg, model_dir, targets="linear_qkv"),
                                                                  ckpt, load_optimizer=False))
        step(plain, batch)
        save_checkpoint(plain, os.path.join(work, "ckpt_base"))
        errors["no_lora_saved"] = refusal(lambda: load_checkpoint(other_alpha, os.path.join(work, "ckpt_base")))
        results["errors"] = errors
    if ps.rank == 0:
        torch.save(results, os.path.join(work, f"{action}-{layout}.pt"))
    end_process_group()


if __name__ == "__main__":  # the dist-checkpoint writer re-imports this script: keep the guard
    main(*sys.argv[1:])
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps({"ok": True}), flush=True)
