"""The RL objective assembled from config: rewards → advantages → per-token loss functions.

Pure torch over a ``TrainBatch``; which functions run is chosen by ``AlgoConfig``
(``megarl/config/schema.py``; presets in ``megarl/config/presets.py``).
"""

from __future__ import annotations

import torch

from megarl.algo.advantage import grpo_advantages, rloo_advantages
from megarl.algo.filters import overlong_ramp, soft_overlong_penalty
from megarl.algo.losses import (
    cispo_loss,
    gspo_loss,
    kl_penalty,
    masked_mean,
    mismatch_metrics,
    ppo_clip_loss,
    value_loss,
)
from megarl.config.schema import AlgoConfig
from megarl.types import Group


def shaped_rewards(groups: list[Group], a: AlgoConfig, max_new_tokens: int) -> torch.Tensor:
    """[groups, G] task rewards plus DAPO's soft over-long penalty when its ramp (``overlong_cache`` tokens, or
    ``overlong_cache_frac`` of the cap) is > 0."""
    ramp = overlong_ramp(a.overlong_cache, a.overlong_cache_frac, max_new_tokens)
    rows = []
    for g in groups:
        row = []
        for s in g.samples:
            r = s.reward
            if ramp:
                r += soft_overlong_penalty(len(s.response_ids), max_new_tokens, ramp, a.overlong_penalty)
            row.append(r)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32)


def group_advantages(rewards: torch.Tensor, kind: str) -> torch.Tensor:
    """[groups, G] → per-sample advantages for the critic-free estimators."""
    if kind == "grpo":
        return grpo_advantages(rewards)
    if kind == "dr_grpo":
        return grpo_advantages(rewards, scale_by_std=False)
    if kind == "rloo":
        return rloo_advantages(rewards)
    raise ValueError(f"{kind!r} is not a group advantage (GAE needs the critic)")


def whiten(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(Â − mean) / std over the masked tokens of the batch."""
    n = mask.sum().clamp(min=1)
    mean = (adv * mask).sum() / n
    var = (((adv - mean) * mask) ** 2).sum() / n
    return (adv - mean) / (var.sqrt() + 1e-8) * mask


def policy_term(logp: torch.Tensor, mb: dict, a: AlgoConfig) -> tuple[torch.Tensor, dict]:
    """The policy term ``algo.policy_loss`` names: PPO-clip, GSPO or CISPO, each weighted by ``is_weight`` if set."""
    args = (logp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"], a.clip_low, a.clip_high)
    if a.policy_loss == "gspo":
        return gspo_loss(*args, mb.get("is_weight"))
    if a.policy_loss == "cispo":
        return cispo_loss(*args, mb.get("is_weight"))
    return ppo_clip_loss(*args, a.dual_clip, mb.get("is_weight"))


def policy_loss_fn(a: AlgoConfig, measure_mismatch: bool = False):
    """ℓ_t = policy term (PPO-clip, GSPO or CISPO) + β·KL_t − c_H·H_t + μ·(−log p_t on positive samples), the last one
    scaled (``nll_scale``) to be a mean over the positive samples' tokens.

    ``measure_mismatch``: also report ``mismatch_metrics`` of this forward's logprobs against ``old_logprobs``; for
    the first optimizer step of a run whose ``old_logprobs`` are the behaviour's (no proximal forward), where the
    weights are still the pre-update ones."""

    def loss(logp: torch.Tensor, mb: dict):
        mask = mb["loss_mask"]
        per_token, metrics = policy_term(logp, mb, a)
        if measure_mismatch:
            metrics.update(mismatch_metrics(logp, mb["old_logprobs"], mask))
        if a.kl_coef:
            kl = kl_penalty(logp, mb["ref_logprobs"], a.kl_estimator) * mask
            per_token = per_token + a.kl_coef * kl
            metrics["kl_ref"] = masked_mean(kl, mask)
        if a.entropy_coef:
            per_token = per_token - a.entropy_coef * mb["entropy"] * mask
        if "entropy" in mb:
            metrics["entropy"] = masked_mean(mb["entropy"], mask)
        if a.positive_nll_coef:
            per_token = per_token - a.positive_nll_coef * logp * mb["nll_scale"]
        return per_token, metrics

    return loss


def value_loss_fn(a: AlgoConfig):
    def loss(values: torch.Tensor, mb: dict):
        return value_loss(values, mb["old_values"], mb["returns"], mb["loss_mask"], a.value_clip)

    return loss
