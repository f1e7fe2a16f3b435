"""Samples → a padded ``TrainBatch``, with loss-aggregation weights.

Aggregation modes (the objective is Σ_t w_t·ℓ_t over the step batch):

- ``token_mean``: w_t = 1 / (response tokens in the batch) — DAPO's token-level loss;
- ``seq_mean_token_mean``: w_t = 1 / (N · |o_i|) — vanilla GRPO, each sequence counts once (N: the
  sequences with a token in the loss; a row the over-long filter masked out is not one);
- ``seq_mean_token_sum_norm``: w_t = 1 / (N · C) with a constant C (e.g. the length cap) —
  Dr. GRPO, which removes the length normalisation's bias.

With Â = −1, a 100-token and a 1000-token sample get per-token weights 1/100 and
1/1000 under ``seq_mean_token_mean`` (the long wrong answer is penalised less per
token) but equal weights under ``token_mean`` and ``seq_mean_token_sum_norm``.
"""

from __future__ import annotations

import numpy as np
import torch

from megarl.types import TrainBatch, no_route


def build_batch(prompts: list[list[int]], responses: list[list[int]], old_logprobs: list[list[float]] | None = None,
                advantages: list[float] | None = None, loss_agg: str = "token_mean", pad_id: int = 0,
                seq_len: int | None = None, norm_tokens: int = 1,
                model_masks: list[list[float]] | None = None) -> TrainBatch:
    """One row per (prompt, response); ``seq_len`` pads every row to a fixed width (pipeline schedules).
    ``model_masks``: per response token, 1.0 where the model sampled it and 0.0 on a multi-turn trajectory's
    environment tokens (``Sample.model_mask``), which then carry loss mask 0 (and so weight 0, no advantage, and no
    part in any per-token mean)."""
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
        if model_masks is not None:
            if len(model_masks[i]) != len(r):
                raise ValueError(f"row {i}: a model mask of {len(model_masks[i])} for {len(r)} response tokens")
            mask[i, start:start + len(r)] = torch.tensor(model_masks[i], dtype=torch.float32)
        if old_logprobs is not None:
            if len(old_logprobs[i]) != len(r):  # (a one-element list would broadcast over the response)
                raise ValueError(f"row {i}: {len(old_logprobs[i])} behaviour logprobs for {len(r)} response tokens")
            old[i, start:start + len(r)] = torch.tensor(old_logprobs[i], dtype=torch.float32)
        if advantages is not None:
            adv[i, start:start + len(r)] = float(advantages[i])
    weights = aggregation_weights(mask, loss_agg, norm_tokens)
    positions = torch.arange(width).unsqueeze(0).expand(n, -1).contiguous()
    lengths = torch.tensor([len(t) - 1 for t in full], dtype=torch.long)
    return TrainBatch(input_ids, positions, labels, mask, weights, old, adv, lengths=lengths)


def batch_routes(routes: list, width: int) -> torch.Tensor | None:
    """The samples' routes (each uint8/int16 [input positions, MoE layers, k], or None: not captured) as one
    [rows, width, MoE layers, k] tensor; positions beyond a sample's routes hold ``no_route`` (the trainer routes
    them itself). None when no sample has routes."""
    known = [r for r in routes if r is not None]
    if not known:
        return None
    layers, k, dtype = known[0].shape[1], known[0].shape[2], known[0].dtype
    out = np.full((len(routes), width, layers, k), no_route(dtype), dtype=dtype)
    for i, r in enumerate(routes):
        if r is not None:
            n = min(len(r), width)
            out[i, :n] = r[:n]
    return torch.from_numpy(out)


def aggregation_weights(mask: torch.Tensor, mode: str, norm_tokens: int = 1) -> torch.Tensor:
    if mode == "token_mean":
        return mask / mask.sum().clamp(min=1)
    if mode == "seq_mean_token_mean":
        per_seq = mask.sum(dim=1, keepdim=True)
        return mask / per_seq.clamp(min=1) / (per_seq > 0).sum().clamp(min=1)
    if mode == "seq_mean_token_sum_norm":
        return mask / (mask.shape[0] * max(norm_tokens, 1))
    raise ValueError(f"unknown loss aggregation {mode!r}; valid: 'token_mean', 'seq_mean_token_mean', "
                     "'seq_mean_token_sum_norm'")


def positive_nll_scale(positive: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-token factors s_t with Σ_t w_t·s_t·x_t = (1/P)·Σ_{positive t} x_t (P: positive tokens): VAPO's LM loss
    on positive samples is a mean over their tokens (Yue et al. 2025), whatever the loss aggregation ``weights``
    (through those it was μ scaled by the share of positive tokens: near 0 at a low pass rate)."""
    count = positive.sum()
    if not count:
        return torch.zeros_like(positive)
    return torch.where(weights > 0, positive / (count * weights.clamp(min=torch.finfo(weights.dtype).tiny)), 0.0)


def per_token(values: list[float], mask: torch.Tensor) -> torch.Tensor:
    """A per-sequence scalar broadcast onto the sequence's response tokens."""
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1) * mask
