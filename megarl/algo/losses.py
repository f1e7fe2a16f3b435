"""Per-token losses; aggregation over tokens is done by the batch's weights (``batch.py``).

Every function returns (per-token loss [N, T], metrics) or a per-token tensor;
gradients flow through the current ``logp`` (and ``values``) only.
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to ±this before exp (as verl does): one token the sampler gave ~e^-90 made the loss inf and
the whole step was skipped. Past the clamp a token's ratio (e^20, far outside any clip band) sends no gradient."""


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (0 when the mask is empty)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                  clip_low: float, clip_high: float, dual_clip: float = 0.0,
                  is_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """PPO-clip (Schulman et al. 2017) with decoupled bounds (DAPO's clip-higher) and optional dual-clip.

    r_t = exp(logp_t − old_logp_t);  J_t = min(r_t·Â_t, clip(r_t, 1−ε_low, 1+ε_high)·Â_t);
    dual-clip (Ye et al. 2020, c > 1): for Â_t < 0, J_t = max(J_t, c·Â_t);  ℓ_t = −w_t·J_t, where w_t is a
    (detached) importance weight, e.g. truncated IS of the trainer/engine mismatch (1 when absent).
    """
    log_ratio = ((logp - old_logp.detach()) * mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    objective = torch.minimum(unclipped, clipped)
    dual = torch.zeros_like(mask)
    if dual_clip > 0:
        floor = dual_clip * adv
        dual = ((adv < 0) & (objective < floor)).float()
        objective = torch.where(adv < 0, torch.maximum(objective, floor), objective)
    if is_weight is not None:
        objective = objective * is_weight.detach()
    metrics = {
        "clip_frac": masked_mean((clipped < unclipped).float(), mask),
        "dual_clip_frac": masked_mean(dual, mask),
        "ratio_mean": masked_mean(ratio, mask),
        "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),  # k3 estimate of KL(old ‖ new)
    }
    return -objective * mask, metrics


def sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean over masked tokens, [N, T] → [N]."""
    return (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def gspo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
              clip_low: float, clip_high: float,
              is_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """GSPO (Zheng et al. 2025): a sequence-level, length-normalised ratio
    s_i = exp((1/|y_i|) Σ_t (logp_t − old_logp_t)),  J_i = min(s_i·Â_i, clip(s_i, 1−ε_low, 1+ε_high)·Â_i).

    ℓ_t = −w_t·J_i on every token t of sequence i, where w_t is a (detached) importance weight applied per
    token as for PPO-clip (1 when absent): truncated IS of the trainer/engine mismatch (Yao et al. 2025; as
    verl multiplies its rollout IS weights into GSPO's per-token loss). Under ``tis: sequence`` w_t = w_i on
    every token, so the sequence's term is −w_i·J_i; under ``tis: token`` the sequence's term (with
    ``seq_mean_token_mean``) is −J_i·mean_t(w_t). Without w, ``old_logp`` being the trainer's own logprobs
    (TIS's decoupled ratio) would leave the engine/trainer mismatch uncorrected.
    With ``seq_mean_token_mean`` weights the objective is the mean of J_i over sequences.
    ``adv`` is per token (constant per sequence).
    """
    seq_log_ratio = sequence_mean(logp - old_logp.detach(), mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    s = torch.exp(seq_log_ratio)
    a = sequence_mean(adv, mask)
    clipped = torch.clamp(s, 1.0 - clip_low, 1.0 + clip_high) * a
    objective = torch.minimum(s * a, clipped)
    per_token = objective.unsqueeze(1).expand_as(mask)
    if is_weight is not None:
        per_token = per_token * is_weight.detach()
    loss = -per_token * mask
    metrics = {
        # the loss tokens of sequences whose clip is active (the clipped branch is the min: no gradient), and the
        # sequence ratio, as token means like every metric: the same however the rows are cut into micro-batches
        "clip_frac": masked_mean((clipped < s * a).float().unsqueeze(1).expand_as(mask), mask),
        "ratio_mean": masked_mean(s.unsqueeze(1).expand_as(mask), mask),
    }
    return loss, metrics


def cispo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
               clip_low: float, clip_high: float,
               is_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """CISPO (MiniMax-M1, Chen et al. 2025): clip the importance weight, not the update.

    r_t = exp(logp_t − old_logp_t);  ℓ_t = −w_t · sg(clip(r_t, 1−ε_low, 1+ε_high)) · Â_t · logp_t, so that
    ∇ℓ_t = −w_t · clip(r_t, 1−ε_low, 1+ε_high) · Â_t · ∇log π_θ(y_t): a token outside the band still sends its
    gradient, weighted at the bound (PPO-clip's min sends none there). ε_low ≥ 1 is no lower bound (MiniMax's
    choice); w_t as for PPO-clip (1 when absent). At r = 1 the gradient is PPO-clip's (−Â·∇log π).
    """
    log_ratio = ((logp.detach() - old_logp.detach()) * mask).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max(1.0 - clip_low, 0.0), 1.0 + clip_high)
    if is_weight is not None:
        weight = weight * is_weight.detach()
    metrics = {
        # tokens whose weight the clip bounds (they keep a gradient, unlike PPO-clip's clip_frac)
        "clip_frac": masked_mean(((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).float(), mask),
        "ratio_mean": masked_mean(ratio, mask),
        "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),  # k3 estimate of KL(old ‖ new)
    }
    return -weight * adv * logp * mask, metrics


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimators of KL(π_θ ‖ π_ref) from samples of π_θ (Schulman 2020, "Approximating KL"):
    k1 = log r, k2 = ½(log r)², k3 = exp(−log r) − 1 + log r, with log r = logp − ref_logp."""
    log_r = logp - ref_logp.detach()
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        log_r = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.expm1(-log_r) + log_r  # (expm1: no fp32 cancellation in exp(x) − 1 for the small x it sees)
    raise ValueError(f"unknown KL estimator {kind!r}; valid: 'k1', 'k2', 'k3'")


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Value regression ½(V − R)², clipped as in PPO when ``clip`` > 0:
    ½·max((V − R)², (clip(V, V_old − ε, V_old + ε) − R)²)."""
    err = (values - returns) ** 2
    if clip > 0:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    return 0.5 * err * mask, {"value_mse": masked_mean((values - returns) ** 2, mask)}


def nll_loss(logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Supervised next-token loss ℓ_t = −log p(y_t) (warm-up; VAPO's positive-example LM term)."""
    loss = -logp * mask
    return loss, {"nll": masked_mean(-logp, mask)}


def mismatch_weights(prox_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                     cap: float = 2.0, low: float = 0.5, high: float = 2.0) -> torch.Tensor:
    """Per-token weight w of the trainer/engine mismatch (detached; 0 off the mask), from the ratio of the trainer's
    pre-update (proximal) policy to the behaviour policy that sampled the token, ρ_t = π_prox(y_t)/π_behaviour(y_t):

    token (TIS, Yao et al. 2025):             w_t = min(ρ_t, C)
    sequence (TIS):                           w_t = min(Π_t ρ_t, C), one weight for every token of the sequence
    mask_token (IcePop, Ling team 2025;       w_t = ρ_t if low ≤ ρ_t ≤ high, else 0: a token outside the band is
      verl's masked IS):                      dropped instead of truncated (its loss and gradient are 0)
    mask_sequence (geometric rejection,       w_t = 1 if low ≤ exp(mean_t log ρ_t) ≤ high, else 0 for every token of
      verl's geo_mean):                       the sequence (the geometric mean, not the product: it does not grow
                                              with the length; a mask, not an importance weight)

    The bounds are inclusive. A masked token keeps its place in the loss aggregation's denominator (IcePop's
    1/Σ|y_i|): it adds 0 to the mean, it does not shrink it.
    """
    log_rho = ((prox_logp - behaviour_logp) * mask).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if mode == "token":
        return torch.clamp(torch.exp(log_rho), max=cap) * mask
    if mode == "sequence":
        return torch.clamp(torch.exp(log_rho.sum(dim=1, keepdim=True)), max=cap) * mask
    if mode == "mask_token":
        rho = torch.exp(log_rho)
        return torch.where((rho >= low) & (rho <= high), rho, torch.zeros_like(rho)) * mask
    if mode == "mask_sequence":
        geo = torch.exp(sequence_mean(log_rho, mask)).unsqueeze(1)
        return ((geo >= low) & (geo <= high)).to(mask.dtype) * mask
    raise ValueError(f"unknown mismatch correction {mode!r}; valid: 'token', 'sequence', 'mask_token', "
                     "'mask_sequence'")


def masked_fractions(weight: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a mismatch mask dropped: the share of trained tokens with weight 0 (``mismatch/masked_token_frac``) and
    of sequences with a trained token with weight 0 (``mismatch/masked_seq_frac``; under ``mask_sequence``: the
    masked sequences)."""
    dropped = ((weight == 0) & (mask > 0)).float()
    has = (mask.sum(dim=1) > 0).float()
    return {
        "mismatch/masked_token_frac": masked_mean(dropped, mask),
        "mismatch/masked_seq_frac": (dropped.amax(dim=1) * has).sum() / has.sum().clamp(min=1),
    }


def mismatch_metrics(trainer_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The trainer/engine gap on the trained tokens, with log ρ_t = log π_trainer(y_t) − log π_behaviour(y_t) from the
    trainer's logprobs under its pre-update weights; masked means:

    mismatch/kl = mean (ρ_t − 1) − log ρ_t, the k3 estimate of KL(π_behaviour ‖ π_trainer) from the behaviour's own
    samples (Schulman 2020; each term ≥ 0, all 0 when the logprobs are equal);  mismatch/abs_mean = mean |log ρ_t|;
    mismatch/nll = mean −log π_trainer(y_t), the trainer's entropy estimated on the sampled tokens (its
    cross-entropy against the behaviour policy: H(π_b) + KL(π_b ‖ π_trainer) in expectation; no full-vocabulary pass).
    k3 is taken in float64 as expm1(log ρ) − log ρ and kept ≥ 0: at the gap of equal weights (|log ρ| ~ 1e-6) the
    float32 exp(log ρ) − 1 − log ρ rounds to either sign, and its mean came out −7e-11.
    """
    log_rho = ((trainer_logp - behaviour_logp) * mask).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    x = log_rho.double()
    return {
        "mismatch/kl": masked_mean((torch.expm1(x) - x).clamp(min=0), mask),
        "mismatch/abs_mean": masked_mean(log_rho.abs(), mask),
        "mismatch/nll": masked_mean(-trainer_logp.detach(), mask),
    }
