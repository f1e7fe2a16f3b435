"""Curriculum by pass rate.

- ``PassRateTracker``: per-prompt pass rate from every released group.
- ``budget_weights``: rollout budget ∝ p(1−p) + ε — prompts the policy solves
  sometimes carry the most signal (a group of a prompt with p ∈ {0, 1} is degenerate).
- ``CurriculumSource``: draws the next prompt from a finite pool with those weights.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable


class PassRateTracker:
    """Counts successes per prompt key; unseen prompts report ``prior``."""

    def __init__(self, prior: float = 0.5) -> None:
        self.prior = prior
        self.passed: dict[Hashable, int] = {}
        self.seen: dict[Hashable, int] = {}

    def update(self, key: Hashable, rewards: list[float]) -> None:
        self.passed[key] = self.passed.get(key, 0) + sum(r >= 1.0 for r in rewards)
        self.seen[key] = self.seen.get(key, 0) + len(rewards)

    def rate(self, key: Hashable) -> float:
        return self.passed[key] / self.seen[key] if self.seen.get(key) else self.prior


def budget_weights(pass_rates: list[float], eps: float = 0.05) -> list[float]:
    """w_i = p_i(1 − p_i) + ε, normalised to sum to 1."""
    raw = [p * (1 - p) + eps for p in pass_rates]
    total = sum(raw)
    return [w / total for w in raw]


class CurriculumSource:
    """Next prompt from a finite pool, drawn ∝ p(1−p) + ε of its tracked pass rate (seeded)."""

    def __init__(self, pool: list, key: Callable[[object], Hashable], tracker: PassRateTracker, eps: float = 0.05,
                 seed: int = 0) -> None:
        if not pool:
            raise ValueError("curriculum pool is empty")
        self.pool, self.key, self.tracker, self.eps = pool, key, tracker, eps
        self.rng = random.Random(seed)

    def __call__(self):
        weights = budget_weights([self.tracker.rate(self.key(x)) for x in self.pool], self.eps)
        return self.rng.choices(self.pool, weights=weights, k=1)[0]

