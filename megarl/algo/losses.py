"""Policy losses, per token; aggregation is done by the batch's weights (see ``batch.py``)."""

from __future__ import annotations

import torch


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                  clip_low: float, clip_high: float) -> tuple[torch.Tensor, dict]:
    """PPO-clip (Schulman et al. 2017) with decoupled bounds (DAPO's clip-higher, Yu et al. 2025).

    r_t = exp(logp_t − old_logp_t);  ℓ_t = −min(r_t·Â_t, clip(r_t, 1−ε_low, 1+ε_high)·Â_t).
    ``old_logp`` is the behaviour logprob of the token as sampled; gradients flow
    through ``logp`` only.
    """
    log_ratio = (logp - old_logp.detach()) * mask
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped) * mask
    n = mask.sum().clamp(min=1)
    metrics = {
        "clip_frac": ((clipped < unclipped).float() * mask).sum() / n,
        "ratio_mean": (ratio * mask).sum() / n,
        "approx_kl": (((ratio - 1) - log_ratio) * mask).sum() / n,  # k3 estimator of KL(old||new)
    }
    return loss, metrics


def nll_loss(logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Supervised next-token loss ℓ_t = −log p(y_t), for the warm-up phase."""
    loss = -logp * mask
    return loss, {"nll": loss.sum() / mask.sum().clamp(min=1)}
