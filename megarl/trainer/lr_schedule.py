"""Learning-rate schedule of the RL steps: linear warm-up, then constant or cosine decay."""

from __future__ import annotations

import math


def lr_at(step: int, base_lr: float, warmup_steps: int, decay: str, total_steps: int, min_lr: float = 0.0) -> float:
    """lr(step) = base·(step+1)/W during warm-up; then base (constant) or
    min + ½(base − min)(1 + cos(π·t)) with t the fraction of the post-warm-up steps done (cosine)."""
    if decay not in ("constant", "cosine"):
        raise ValueError(f"lr decay must be 'constant' or 'cosine', got {decay!r}")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if decay == "constant" or total_steps <= warmup_steps:
        return base_lr
    t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * t))


def policy_lr(cfg, step: int) -> float:
    """The policy's LR at RL step ``step`` (0-based): its schedule starts with its first update, after the
    critic's ``algo.critic_warmup_steps`` (as verl's actor scheduler, stepped by actor updates only); without it
    VAPO's policy began at full LR, its warm-up spent while it was frozen. The critic's LR is constant."""
    o, frozen = cfg.optim, cfg.algo.critic_warmup_steps
    return lr_at(max(step - frozen, 0), o.lr, o.lr_warmup_steps, o.lr_decay, cfg.train.steps - frozen, o.min_lr)
