"""One RL update from released groups: batch → (reference, proximal, critic) forwards → advantages →
critic and policy optimizer steps over mini-batches and inner epochs.

The learners are handed in (policy, optional critic and frozen reference); this
module knows the algorithm's data flow, not engines or scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch

from megarl.algo.advantage import gae, length_adaptive_lambda, outcome_rewards_to_tokens
from megarl.algo.batch import aggregation_weights, batch_routes, build_batch, per_token, positive_nll_scale
from megarl.algo.filters import overlong_mask
from megarl.algo.losses import masked_fractions, mismatch_metrics, mismatch_weights, sequence_mean
from megarl.algo.minibatches import minibatch_rows
from megarl.algo.objective import group_advantages, policy_loss_fn, shaped_rewards, value_loss_fn, whiten
from megarl.config.schema import RunConfig
from megarl.config.validate.algo import resolved_decoupled_ppo
from megarl.trainer.lora import adapters_off, tie_dropout
from megarl.trainer.policy import PolicyTrainer
from megarl.types import Group, TrainBatch


@dataclass
class Learners:
    policy: PolicyTrainer
    critic: PolicyTrainer | None = None
    reference: PolicyTrainer | AdaptersOff | HostReference | None = None

    def named(self) -> list[tuple[str, PolicyTrainer]]:
        """The learners there are, by name (a run checkpoint's directories): the policy, and the critic and the
        reference where the algorithm has them (a LoRA run's reference is the policy's base: nothing of its own; a
        host-resident one its weights' holder)."""
        reference = self.reference.weights if isinstance(self.reference, HostReference) else self.reference
        return [(n, t) for n, t in (("policy", self.policy), ("critic", self.critic), ("reference", reference))
                if isinstance(t, PolicyTrainer)]


class HostReference:
    """``trainer.reference_on_host``: the KL reference's weights (``weights``, a frozen ``PolicyTrainer`` built on
    the host) copied into the policy's own model for its forward, the policy's weights put back bit for bit after;
    no second model on the GPU. Each rank swaps its own shards: the two models are built alike, parameter for
    parameter. The forward routes freely, as a reference of its own does (no routing replay)."""

    def __init__(self, policy: PolicyTrainer, weights: PolicyTrainer) -> None:
        self.policy, self.weights = policy, weights
        self.pairs = []
        for mine, theirs in zip(policy.modules, weights.modules, strict=True):
            for (name, p), (other, r) in zip(mine.named_parameters(), theirs.named_parameters(), strict=True):
                if name != other or p.shape != r.shape:
                    raise RuntimeError(f"the host reference's {other} {tuple(r.shape)} is not the policy's {name} "
                                       f"{tuple(p.shape)}: they must be built alike")
                self.pairs.append((p, r))
        pin = torch.cuda.is_available()  # (pinned host memory: the copies run at the link's rate)
        self.stash = [torch.empty(r.shape, dtype=r.dtype, pin_memory=pin) for _, r in self.pairs]  # the policy's

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        with torch.no_grad():
            for (p, r), kept in zip(self.pairs, self.stash):
                kept.copy_(p.data)
                p.data.copy_(r.data)
        try:
            return self.policy.logprobs(replace(batch, routes=None))
        finally:
            with torch.no_grad():
                for (p, _), kept in zip(self.pairs, self.stash):
                    p.data.copy_(kept)


class AdaptersOff:
    """A LoRA run's KL reference: the policy with its adapters off, which is the frozen base model (no second
    model in memory, ``trainer.lora.adapters_off``)."""

    def __init__(self, policy: PolicyTrainer) -> None:
        self.policy = policy

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        with adapters_off(self.policy.modules):
            return self.policy.logprobs(batch)


def norm_tokens(cfg: RunConfig) -> int:
    """Dr. GRPO's constant normaliser: ``algo.loss_norm_tokens``, by default the length cap."""
    return cfg.algo.loss_norm_tokens or cfg.rollout.max_new_tokens


def rollout_batch(groups: list[Group], cfg: RunConfig, pad_id: int,
                  hold_routes=None) -> tuple[TrainBatch, torch.Tensor]:
    """All samples of the groups as one batch (behaviour logprobs as ``old_logprobs``), and [groups, G] rewards.
    ``hold_routes(arrays, batch)``: the samples' routes as the batch carries them (``PolicyTrainer.hold_routes``:
    this rank's share); by default one [N, T, MoE layers, k] tensor."""
    a = cfg.algo
    samples = [s for g in groups for s in g.samples]
    batch = build_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                        [s.logprobs for s in samples], loss_agg=a.loss_agg, pad_id=pad_id,
                        norm_tokens=norm_tokens(cfg),
                        model_masks=[s.model_mask() for s in samples] if any(s.env_spans for s in samples) else None)
    arrays = [s.route_array() for s in samples]
    batch.routes = hold_routes(arrays, batch) if hold_routes else batch_routes(arrays, batch.seq_len)
    if a.overlong_filter:
        batch.loss_mask = overlong_mask([s.finish_reason for s in samples], batch.loss_mask)
    rewards = shaped_rewards(groups, a, cfg.rollout.max_new_tokens)
    batch.positive = per_token([float(s.reward >= 1.0) for s in samples], batch.loss_mask)
    return batch, rewards


def _train(learner: PolicyTrainer, batch: TrainBatch, loss_fn, cfg: RunConfig, seed: int,
           first_loss_fn=None) -> dict[str, float]:
    """``ppo_epochs`` × ``minibatches`` optimizer steps; each mini-batch re-normalises its own weights. The first step
    runs ``first_loss_fn`` when given (the weights are still the pre-update ones there); each metric is the mean over
    the steps that report it."""
    a = cfg.algo
    priority = sequence_mean(batch.advantages.abs(), batch.loss_mask)
    gen = torch.Generator().manual_seed(seed)
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    steps = minibatch_rows(priority, a.minibatches, a.ppo_epochs, a.prioritized_replay, gen)
    for i, rows in enumerate(steps):
        mb = batch.select(rows) if len(steps) > 1 else replace(batch)
        mb.weights = aggregation_weights(mb.loss_mask, a.loss_agg, norm_tokens(cfg))
        if a.positive_nll_coef and mb.positive is not None:  # (the critic's loss has no such term)
            mb.nll_scale = positive_nll_scale(mb.positive, mb.weights)
        for k, v in learner.train_step(mb, first_loss_fn if i == 0 and first_loss_fn else loss_fn).items():
            sums[k] = sums.get(k, 0.0) + v
            counts[k] = counts.get(k, 0) + 1
    return {k: v / counts[k] for k, v in sums.items()}


def proximal_level(a, decoupled: bool) -> str | None:
    """The mismatch correction when the loss clips against the proximal policy (``algo.tis``: truncated IS or a mask
    of π_prox/π_behaviour, ``mismatch_weights``; ``decoupled``, ``algo.decoupled_ppo`` as resolved, alone: 'token'),
    None when it clips against the behaviour policy."""
    if a.tis != "none":
        return a.tis
    return "token" if decoupled else None


def proximal_correction(prox: torch.Tensor, batch: TrainBatch, mode: str, a) -> dict[str, float]:
    """Decoupled: the ratio against the proximal logprobs ``prox``, the mismatch weight on each token
    (``batch.old_logprobs`` are the behaviour's on entry, ``prox`` on return); the mismatch metrics of the batch."""
    mask = batch.loss_mask
    out = {k: float(v) for k, v in mismatch_metrics(prox, batch.old_logprobs, mask).items()}
    out["mismatch/abs_max"] = float(((prox - batch.old_logprobs) * mask).abs().max())
    batch.is_weight = mismatch_weights(prox, batch.old_logprobs, mask, mode, a.tis_cap, a.mask_low, a.mask_high)
    if mode.startswith("mask_"):
        out.update({k: float(v) for k, v in masked_fractions(batch.is_weight, mask).items()})
    batch.old_logprobs = prox
    return out


def rl_update(learners: Learners, groups: list[Group], cfg: RunConfig, pad_id: int, step: int) -> dict[str, float]:
    a = cfg.algo
    # (rank 0 alone holds the samples' routes: the rollout leader's, rollout/leader.py; it sends each rank its share)
    batch, rewards = rollout_batch(groups, cfg, pad_id, partial(learners.policy.hold_routes, source=0))
    mask = batch.loss_mask
    out: dict[str, float] = {"loss/tokens": float(mask.sum())}  # (a trajectory's environment tokens: not among them)
    engine_routes, agreement, own = batch.routes, {}, None
    if a.routing_replay == "trainer" and learners.policy.taps:  # R2: this step's first routes, replayed in its updates
        batch.routes, own = learners.policy.record_routes(batch)
        agreement = dict(learners.policy.route_stats) if engine_routes is not None else {}  # own vs the engine's
    if (level := proximal_level(a, resolved_decoupled_ppo(cfg))) is not None:  # decoupled: ratio against the
        # proximal policy, IS weight for the rest (the policy before this update: AReaL's proximal policy; R2's
        # recording pass computed it already)
        prox = own if own is not None else learners.policy.logprobs(batch)
        out.update(proximal_correction(prox, batch, level, a))
    if learners.reference is not None:
        batch.ref_logprobs = learners.reference.logprobs(batch)
    if a.advantage == "gae":
        values = learners.critic.logprobs(batch) * mask
        token_rewards = outcome_rewards_to_tokens(rewards.flatten(), mask)
        lam = length_adaptive_lambda(mask.sum(dim=1), a.length_adaptive_alpha) if a.length_adaptive_alpha else a.lam
        adv, _ = gae(token_rewards, values, mask, a.gamma, lam)
        _, batch.returns = gae(token_rewards, values, mask, a.gamma, a.lam_critic)
        batch.old_values = values
        batch.advantages = whiten(adv, mask) if a.whiten_advantages else adv
        critic_metrics = _train(learners.critic, batch, value_loss_fn(a), cfg, seed=step)
        out.update({f"critic/{k}": v for k, v in critic_metrics.items()})
    else:
        batch.advantages = per_token(group_advantages(rewards, a.advantage).flatten().tolist(), mask)
    if step < a.critic_warmup_steps:  # value pre-training: the policy waits for a useful critic (no loss/* logged)
        return out
    # without a proximal forward, the mismatch is measured in the first training forward (pre-update weights)
    measure = policy_loss_fn(a, measure_mismatch=True) if level is None else None
    if cfg.lora.dropout and learners.policy.adapters:  # the step's masks of TP-replicated inputs: from the step alone
        tie_dropout(learners.policy.adapters, cfg.train.seed, step)
    policy = _train(learners.policy, batch, policy_loss_fn(a), cfg, seed=step + 1, first_loss_fn=measure)
    out.update({
        "loss/policy": policy.get("loss", 0.0),
        "loss/clip_frac": policy.get("clip_frac", 0.0),
        "loss/approx_kl": policy.get("approx_kl", 0.0),
        "loss/grad_norm": policy.get("grad_norm", 0.0),
    })
    for key in ("kl_ref", "entropy", "dual_clip_frac"):
        if key in policy:
            out[f"loss/{key}"] = policy[key]
    out.update({k: v for k, v in policy.items() if k.startswith("mismatch/")})
    if a.routing_replay != "trainer":  # routing agreement with the engine (trainer/routing.py); R2's: measured above
        agreement = {k: v for k, v in policy.items() if k.startswith("moe/")}
    out.update(agreement)
    return out
