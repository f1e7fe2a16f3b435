"""Samples → a padded ``TrainBatch``, with loss-aggregation weights.

Aggregation modes (the objective is Σ_t w_t·ℓ_t over the step batch):

- ``token_mean``: w_t = 1 / (response tokens in the batch) — DAPO's token-level loss;
- ``seq_mean_token_mean``: w_t = 1 / (N · |o_i|) — vanilla GRPO, each sequence counts once.
"""

from __future__ import annotations

import torch

from megarl.types import TrainBatch


def build_batch(prompts: list[list[int]], responses: list[list[int]], old_logprobs: list[list[float]] | None = None,
                advantages: list[float] | None = None, loss_agg: str = "token_mean", pad_id: int = 0,
                seq_len: int | None = None) -> TrainBatch:
    """One row per (prompt, response); ``seq_len`` pads every row to a fixed width (pipeline schedules)."""
    n = len(prompts)
    full = [list(p) + list(r) for p, r in zip(prompts, responses)]
    width = max(len(t) for t in full) - 1
    if seq_len is not None:
        if seq_len < width:
            raise ValueError(f"seq_len {seq_len} is shorter than the longest sequence ({width})")
        width = seq_len
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width))
    old = torch.zeros((n, width))
    adv = torch.zeros((n, width))
    for i, (p, r, toks) in enumerate(zip(prompts, responses, full)):
        length = len(toks) - 1
        input_ids[i, :length] = torch.tensor(toks[:-1])
        labels[i, :length] = torch.tensor(toks[1:])
        start = len(p) - 1  # label position of the first response token
        mask[i, start:start + len(r)] = 1.0
        if old_logprobs is not None:
            old[i, start:start + len(r)] = torch.tensor(old_logprobs[i], dtype=torch.float32)
        if advantages is not None:
            adv[i, start:start + len(r)] = float(advantages[i])
    weights = aggregation_weights(mask, loss_agg)
    positions = torch.arange(width).unsqueeze(0).expand(n, -1).contiguous()
    return TrainBatch(input_ids, positions, labels, mask, weights, old, adv)


def aggregation_weights(mask: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "token_mean":
        return mask / mask.sum().clamp(min=1)
    if mode == "seq_mean_token_mean":
        per_seq = mask.sum(dim=1, keepdim=True).clamp(min=1)
        return mask / per_seq / mask.shape[0]
    raise ValueError(f"unknown loss aggregation {mode!r}; valid: 'token_mean', 'seq_mean_token_mean'")
