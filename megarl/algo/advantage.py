"""Advantage estimators for outcome rewards."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6, scale_by_std: bool = True) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): Â_i = (r_i − mean(r_group)) / (std(r_group) + eps).

    ``rewards`` is [groups, G]; the same scalar advantage applies to every token of
    sample i. With ``scale_by_std=False`` this is Dr. GRPO's unscaled baseline
    (Liu et al. 2025). The std is the population std (unbiased=False), so a group
    whose rewards all match gets Â = 0 for every member.
    """
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    if not scale_by_std:
        return centered
    return centered / (rewards.std(dim=-1, keepdim=True, unbiased=False) + eps)
