"""Advantage estimators: group baselines for outcome rewards (GRPO, Dr. GRPO, RLOO) and GAE (PPO, VAPO)."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6, scale_by_std: bool = True) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): Â_i = (r_i − mean(r_group)) / (std(r_group) + eps).

    ``rewards`` is [groups, G]; the same scalar advantage applies to every token of
    sample i. With ``scale_by_std=False`` this is Dr. GRPO's unscaled baseline
    (Liu et al. 2025, "Understanding R1-Zero-Like Training"). The std is the
    population std, so a group whose rewards all match gets Â = 0 for every member.
    """
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    if not scale_by_std:
        return centered
    return centered / (rewards.std(dim=-1, keepdim=True, unbiased=False) + eps)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): Â_i = r_i − (1/(G−1)) Σ_{j≠i} r_j = G/(G−1) · (r_i − mean(r))."""
    g = rewards.shape[-1]
    if g < 2:
        raise ValueError("RLOO needs at least 2 samples per group")
    return (rewards - rewards.mean(dim=-1, keepdim=True)) * g / (g - 1)


def length_adaptive_lambda(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO (Yue et al. 2025): λ_policy = 1 − 1/(α·l) for a response of length l (clamped to [0, 1])."""
    return (1.0 - 1.0 / (alpha * lengths.float().clamp(min=1))).clamp(0.0, 1.0)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over masked, right-padded responses.

    δ_t = r_t + γ·V_{t+1} − V_t,  Â_t = Σ_l (γλ)^l δ_{t+l},  returns R_t = Â_t + V_t,
    with V = 0 after a response's last token. ``rewards``, ``values``, ``mask`` are
    [N, T]; ``lam`` is a scalar or a per-sequence tensor [N] (length-adaptive λ).
    With γ = λ = 1, Â_t = (reward-to-go)_t − V_t. Positions off the mask are skipped, not ends: inside a
    multi-turn trajectory t+1 is the model's next token after the environment's (padding after the last token
    changes nothing).
    """
    n, t = rewards.shape
    lam_t = torch.as_tensor(lam, dtype=values.dtype).expand(n) if not torch.is_tensor(lam) or lam.dim() == 0 else lam
    adv = torch.zeros_like(values)
    running = torch.zeros(n, dtype=values.dtype)
    next_value = torch.zeros(n, dtype=values.dtype)
    for i in reversed(range(t)):
        m = mask[:, i] > 0
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        running = torch.where(m, delta + gamma * lam_t * running, running)  # off the mask: neither adds nor cuts
        adv[:, i] = running * m
        next_value = torch.where(m, values[:, i], next_value)
    return adv, (adv + values) * mask


def outcome_rewards_to_tokens(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar reward on its last response token ([N] → [N, T])."""
    out = torch.zeros_like(mask, dtype=torch.float32)
    last = mask.shape[1] - 1 - torch.flip(mask, dims=[1]).argmax(dim=1)
    has = mask.sum(dim=1) > 0
    out[torch.arange(mask.shape[0])[has], last[has]] = rewards[has].float()
    return out


def vapo_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, alpha: float,
                    gamma: float = 1.0, lam_critic: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """VAPO's decoupled GAE: value targets with λ_critic (1.0: unbiased Monte-Carlo returns), policy
    advantages with the length-adaptive λ_policy = 1 − 1/(α·l). Returns (advantages, value targets)."""
    token_rewards = outcome_rewards_to_tokens(rewards, mask)
    _, targets = gae(token_rewards, values, mask, gamma, lam_critic)
    adv, _ = gae(token_rewards, values, mask, gamma, length_adaptive_lambda(mask.sum(dim=1), alpha))
    return adv, targets
