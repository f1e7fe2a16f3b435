"""Which rows of a rollout batch each optimizer step of an RL update trains on (``algo.minibatches`` ×
``algo.ppo_epochs``; ``algo.prioritized_replay`` orders them by |advantage|)."""

from __future__ import annotations

import torch


def minibatch_rows(advantages: torch.Tensor, minibatches: int, epochs: int, prioritized: bool,
                   generator: torch.Generator) -> list[torch.Tensor]:
    """Row indices of each optimizer step: ``epochs`` passes of ``minibatches`` mini-batches.

    Uniform: each epoch is a fresh permutation split in equal parts. Prioritized: rows are
    drawn without replacement with probability ∝ |Â_i| + 1e-6 (``advantages`` is [N], the
    per-sequence mean |Â|), so informative samples come first in each epoch.
    """
    n = advantages.shape[0]
    out = []
    for _ in range(epochs):
        if prioritized:
            order = torch.multinomial(advantages.abs() + 1e-6, n, replacement=False, generator=generator)
        else:
            order = torch.randperm(n, generator=generator)
        out.extend(chunk for chunk in torch.chunk(order, minibatches) if len(chunk))
    return out
