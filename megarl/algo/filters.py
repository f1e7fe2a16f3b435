"""Rollout filters and reward shaping from DAPO (Yu et al. 2025), with the arithmetic behind them."""

from __future__ import annotations

import torch

from megarl.types import Group


def is_informative(group: Group) -> bool:
    """Dynamic sampling: a group whose rewards all match has Â = 0 everywhere and teaches nothing."""
    rewards = [s.reward for s in group.samples]
    return max(rewards) != min(rewards)


def degenerate_group_probability(p: float, group_size: int) -> float:
    """P(all G samples agree) = p^G + (1−p)^G for a prompt solved with probability p."""
    return p**group_size + (1 - p) ** group_size


def oversampling_factor(degenerate_fraction: float) -> float:
    """Groups to generate per useful group when a fraction of groups is degenerate: 1 / (1 − f)."""
    if not 0 <= degenerate_fraction < 1:
        raise ValueError(f"degenerate fraction must be in [0, 1), got {degenerate_fraction}")
    return 1.0 / (1.0 - degenerate_fraction)


def overlong_mask(finish_reasons: list[str], mask: torch.Tensor) -> torch.Tensor:
    """Over-long filtering: zero the loss mask of samples truncated by the length cap."""
    keep = torch.tensor([reason != "length" for reason in finish_reasons], dtype=mask.dtype)
    return mask * keep.unsqueeze(1)


def overlong_ramp(cache: int, frac: float, max_len: int) -> int:
    """L_cache in tokens: ``cache`` when set, else ``frac`` of the cap ``max_len`` (``algo.overlong_cache`` /
    ``algo.overlong_cache_frac``); 0: no over-long penalty."""
    return cache if cache else round(frac * max_len)


def soft_overlong_penalty(length: int, max_len: int, cache_len: int, penalty: float = 1.0) -> float:
    """DAPO's soft over-long punishment: 0 up to the soft start L_max − L_cache, then linear down to −λ at
    L_max (and −λ beyond): R = λ·((L_max − L_cache) − |y|) / L_cache in between."""
    start = max_len - cache_len
    if length <= start:
        return 0.0
    if length >= max_len:
        return -penalty
    return penalty * (start - length) / cache_len
