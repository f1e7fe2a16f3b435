"""``algo.*`` checks before launch: numeric ranges and key combinations (choices: their ``Literal`` types).

Every check here stands for a run that would otherwise start and then go wrong:
a negative ``kl_coef`` or ``entropy_coef`` crashes at step 1 (the reference model
and the entropy are only computed for coefficients > 0, ``session.build_learners``),
``oversample_cap`` 0 is the controller's "no cap" and loops forever on a phase of
uninformative groups, ``critic_warmup_steps`` ≥ ``train.steps`` never moves the
policy, and critic-only switches with a group advantage (no critic is built) do
nothing or skip policy steps. Defaults always pass.

``algo_notes`` says, before launch, what is allowed but likely unmeant: stale samples trained
with no off-policy correction.
"""

from __future__ import annotations

from megarl.config.errors import ConfigError
from megarl.config.presets import PRESETS
from megarl.config.schema import AlgoConfig, RunConfig

# (key, what it is): must be >= 0; ``not value >= 0`` also refuses NaN.
_AT_LEAST_ZERO = (
    ("kl_coef", "the KL penalty's β; 0: off, no reference model"),
    ("entropy_coef", "the entropy bonus's coefficient; 0: off"),
    ("positive_nll_coef", "the LM loss weight on positive samples; 0: off"),
    ("value_clip", "the value loss's clip range around the old values; 0: off"),
    ("loss_norm_tokens", "Dr. GRPO's normaliser in tokens; 0: rollout.max_new_tokens"),
    ("overlong_cache", "the over-long penalty ramp in tokens; 0: off"),
    ("overlong_penalty", "the over-long penalty reached at the cap"),
    ("length_adaptive_alpha", "VAPO's α of λ_policy = 1 − 1/(α·l); 0: off, use lam"),
    ("critic_warmup_steps", "RL steps that train only the critic; 0: none"),
)

# Keys only GAE reads (its discount and λs, the critic's loss and learning rate); with a group advantage a value
# other than the default is a setting the run would silently ignore.
_GAE_ONLY = ("gamma", "lam", "lam_critic", "value_clip", "critic_lr")


def needed_learners(a, lora_rank: int = 0) -> dict[str, str]:
    """The learners beside the policy that ``algo`` (an ``AlgoConfig``) builds, each with the setting that
    needs it: a critic for GAE, the frozen reference for a KL penalty (with LoRA, ``lora_rank`` > 0, none: the
    reference is the policy with its adapters off). ``session.build_learners`` builds exactly these;
    ``validate.model.check_resume_learners`` requires them in the checkpoint a run resumes from."""
    needed = {}
    if a.advantage == "gae":
        needed["critic"] = "algo.advantage=gae trains a critic"
    if a.kl_coef > 0 and lora_rank <= 0:
        needed["reference"] = f"algo.kl_coef={a.kl_coef} needs the frozen reference model"
    return needed


def reference_kept(cfg: RunConfig) -> str:
    """Where the frozen reference model ``needed_learners`` builds keeps its weights: 'host'
    (``trainer.reference_on_host``: copied into the policy's model for its forward), 'device', or '' (no such model:
    no KL penalty, or LoRA's base with its adapters off)."""
    if "reference" not in needed_learners(cfg.algo, cfg.lora.rank):
        return ""
    return "host" if cfg.trainer.reference_on_host else "device"


def validate_algo(cfg: RunConfig) -> None:
    """Raise ConfigError naming the ``algo`` key, its value and what is valid."""
    _ranges(cfg)
    _combinations(cfg)


def _ranges(cfg: RunConfig) -> None:
    a = cfg.algo
    for key, what in _AT_LEAST_ZERO:
        value = getattr(a, key)
        if not value >= 0:
            raise ConfigError(f"algo.{key} must be >= 0 ({what}), got {value}")
    for key in ("gamma", "lam", "lam_critic"):
        value = getattr(a, key)
        if not 0 <= value <= 1:
            raise ConfigError(f"algo.{key} must be in [0, 1] (a GAE discount / λ: above 1 the advantages diverge, "
                              "below 0 their terms alternate in sign), "
                              f"got {value}")
    if a.policy_loss == "cispo" and not 0 <= a.clip_low <= 1:
        raise ConfigError(f"algo.clip_low must be in [0, 1] with algo.policy_loss=cispo (the importance weight's lower "
                          f"bound is 1 − clip_low; 1: none, MiniMax's choice), got {a.clip_low}")
    if a.policy_loss != "cispo" and not 0 <= a.clip_low < 1:
        raise ConfigError(f"algo.clip_low must be in [0, 1) (the ratio's lower bound 1 − clip_low must stay above 0), "
                          f"got {a.clip_low}")
    if not a.clip_high >= 0:
        raise ConfigError(f"algo.clip_high must be >= 0 (the ratio's upper bound is 1 + clip_high), got {a.clip_high}")
    if a.dual_clip and not a.dual_clip > 1:
        raise ConfigError(f"algo.dual_clip must be > 1 (or 0 for off), got {a.dual_clip}")
    if not a.critic_lr > 0:
        raise ConfigError(f"algo.critic_lr must be > 0 (the critic's learning rate), got {a.critic_lr}")
    if not a.curriculum_eps > 0:  # at 0, a pool whose pass rates are all 0 or 1 has no weight to draw by
        raise ConfigError(f"algo.curriculum_eps must be > 0 (the ε of weights p(1−p) + ε), got {a.curriculum_eps}")
    if not a.tis_cap > 0:
        raise ConfigError(f"algo.tis_cap must be > 0, got {a.tis_cap}")
    if not 0 <= a.mask_low < 1:  # (a band without 1 would drop the tokens trainer and engine agree on, ρ ≈ 1)
        raise ConfigError(f"algo.mask_low must be in [0, 1) (the lower bound of the band of π_prox/π_behaviour that "
                          f"algo.tis=mask_token|mask_sequence keeps, which must hold ρ = 1; 0: none), got {a.mask_low}")
    if not a.mask_high > 1:
        raise ConfigError(f"algo.mask_high must be > 1 (the upper bound of the band of π_prox/π_behaviour that "
                          f"algo.tis=mask_token|mask_sequence keeps, which must hold ρ = 1), got {a.mask_high}")
    if not 0 <= a.overlong_cache_frac < 1:
        raise ConfigError(f"algo.overlong_cache_frac must be in [0, 1) (the over-long penalty ramp as a share of "
                          f"rollout.max_new_tokens; DAPO: 0.2; 0: off), got {a.overlong_cache_frac}")
    if a.ppo_epochs < 1 or a.minibatches < 1:
        raise ConfigError(f"algo.ppo_epochs and algo.minibatches must be >= 1, got {a.ppo_epochs}, {a.minibatches}")


def _combinations(cfg: RunConfig) -> None:
    a, r = cfg.algo, cfg.rollout
    if a.dynamic_sampling and not a.oversample_cap >= 1:
        raise ConfigError(f"algo.oversample_cap must be >= 1 with algo.dynamic_sampling (a phase ends after "
                          f"oversample_cap × rollout.prompts_per_step released groups, useful or not; below 1 no "
                          f"phase could fill its batch, and 0 would loop forever on uninformative groups), "
                          f"got {a.oversample_cap}")
    if 0 < r.top_p < 1 and a.tis == "none" and not resolved_decoupled_ppo(cfg):  # (out of (0, 1]: range check says so)
        raise ConfigError(f"rollout.top_p={r.top_p} with algo.tis=none: the engine's behaviour logprobs are of the "
                          "nucleus it samples from (renormalised), the trainer's of the whole vocabulary, so the "
                          "importance ratio starts near the nucleus mass instead of 1 (with GSPO's clip band every "
                          "negative-advantage sequence would get no gradient). Set rollout.top_p=1 (usual for RL "
                          "rollouts) or algo.tis=token|sequence (the ratio is then against the trainer's own "
                          "logprobs and the sampler's difference is an importance weight)")
    if a.kl_coef and a.kl_estimator == "k1":
        raise ConfigError(f"algo.kl_estimator=k1 with algo.kl_coef={a.kl_coef}: k1 = log(π/π_ref) as a loss term has "
                          "zero expected gradient (E_π[∇log π] = 0; it adds noise, no penalty: Tang & Munos 2025). "
                          "Use k2 (its gradient is that of KL(π‖π_ref)) or k3 (that of KL(π_ref‖π); GRPO's, the "
                          "default)")
    if a.minibatches > r.prompts_per_step * r.samples_per_prompt:
        raise ConfigError(f"algo.minibatches={a.minibatches} exceeds the samples per step "
                          f"({r.prompts_per_step} × {r.samples_per_prompt})")
    if a.curriculum and cfg.data.pool_size < 1:
        raise ConfigError("algo.curriculum needs a finite prompt pool: set data.pool_size > 0")
    if a.overlong_cache >= r.max_new_tokens:
        raise ConfigError(f"algo.overlong_cache ({a.overlong_cache}) must be < rollout.max_new_tokens "
                          f"({r.max_new_tokens})")
    # (the ramp in tokens, as algo/filters.py's overlong_ramp takes it)
    if not a.overlong_cache and round(a.overlong_cache_frac * r.max_new_tokens) >= r.max_new_tokens:
        raise ConfigError(f"algo.overlong_cache_frac={a.overlong_cache_frac} of rollout.max_new_tokens "
                          f"({r.max_new_tokens}) leaves no response length unpenalised: the ramp must be shorter than "
                          "the cap (DAPO: 0.2)")
    if a.policy_loss != "ppo" and a.dual_clip:
        raise ConfigError(f"algo.dual_clip={a.dual_clip} does not apply with algo.policy_loss={a.policy_loss} (dual "
                          "clip bounds PPO-clip's token objective; GSPO's sequence ratio and CISPO's clipped weight "
                          "have none); set algo.dual_clip=0 or algo.policy_loss=ppo")
    if a.critic_warmup_steps and a.critic_warmup_steps >= cfg.train.steps:
        raise ConfigError(f"algo.critic_warmup_steps={a.critic_warmup_steps} must be < train.steps "
                          f"({cfg.train.steps}): the policy trains only from step critic_warmup_steps + 1 on, so this "
                          "run would never update it")
    if a.advantage != "gae":
        group = f"with algo.advantage={a.advantage} (a group advantage: no critic is built; these apply to gae)"
        if a.critic_warmup_steps:
            raise ConfigError(f"algo.critic_warmup_steps={a.critic_warmup_steps} {group}: the first "
                              f"{a.critic_warmup_steps} steps would skip the policy update and train nothing; "
                              "set algo.critic_warmup_steps=0 or algo.advantage=gae")
        if a.whiten_advantages:
            raise ConfigError(f"algo.whiten_advantages=true {group}: it would be ignored; set "
                              "algo.whiten_advantages=false or algo.advantage=gae")
        preset = PRESETS.get(a.preset, {})
        changed = [f"algo.{k}={getattr(a, k)}" + (f" (from algo.preset={a.preset})" if preset.get(k) == getattr(a, k)
                                                  else "")
                   for k in _GAE_ONLY if getattr(a, k) != getattr(AlgoConfig, k)]
        if changed:
            raise ConfigError(f"{', '.join(changed)} {group}: they would be ignored; leave them at their defaults "
                              "(override a preset's) or set algo.advantage=gae")
        if a.length_adaptive_alpha:
            raise ConfigError(f"algo.length_adaptive_alpha={a.length_adaptive_alpha} {group}: it would be ignored; "
                              "set algo.length_adaptive_alpha=0 or algo.advantage=gae")


def stale_source(cfg: RunConfig) -> str:
    """What makes this run train tokens sampled by older weights ('' when nothing can): one-step overlap, async
    overlap or partial rollouts with ``rollout.staleness_limit`` k ≥ 1 (at k = 0 both are as fresh as 'none')."""
    r = cfg.rollout
    if r.overlap == "one_step":
        return "rollout.overlap=one_step trains every batch 1 version after the weights that sampled it"
    if r.overlap == "async" and r.staleness_limit >= 1:
        return (f"rollout.overlap=async with rollout.staleness_limit={r.staleness_limit} trains tokens up to "
                f"{r.staleness_limit} versions old")
    if r.mode == "partial" and r.staleness_limit >= 1:
        return (f"rollout.mode=partial with rollout.staleness_limit={r.staleness_limit} resumes samples whose tokens "
                f"are up to {r.staleness_limit} versions old")
    return ""


def resolved_decoupled_ppo(cfg: RunConfig) -> bool:
    """``algo.decoupled_ppo`` as the run applies it ('auto': on where the run trains stale tokens that no other key
    corrects, ``stale_source``)."""
    a = cfg.algo
    if a.decoupled_ppo != "auto":
        return a.decoupled_ppo
    return bool(stale_source(cfg)) and a.tis == "none" and a.policy_loss != "cispo"


def off_policy_correction(cfg: RunConfig) -> str:
    """The key that corrects the objective for off-policy tokens ('' when none does): a decoupled ratio with its
    truncated IS weight or mask (``algo.tis``, ``algo.decoupled_ppo``), or CISPO's clipped importance weight."""
    a = cfg.algo
    if a.tis != "none":
        return f"algo.tis={a.tis}"
    if resolved_decoupled_ppo(cfg):
        return "algo.decoupled_ppo=" + ("auto" if a.decoupled_ppo == "auto" else "true")
    return "algo.policy_loss=cispo" if a.policy_loss == "cispo" else ""


def algo_notes(cfg: RunConfig) -> list[str]:
    """Said before launch, not refused: stale data trained by a loss that clips against the behaviour policy with no
    off-policy correction (PPO-clip or GSPO with the engine's logprobs as the old policy)."""
    a, r = cfg.algo, cfg.rollout
    source = stale_source(cfg)
    if not source or off_policy_correction(cfg):
        return []
    areal = (" (plain PPO against the behaviour policy was found unstable beyond staleness 2: AReaL)"
             if r.overlap != "one_step" and r.staleness_limit > 2 else "")
    return [f"{source}, and algo.policy_loss={a.policy_loss} clips against the behaviour policy with no off-policy "
            f"correction{areal} (algo.decoupled_ppo=false turns off the default one): leave algo.decoupled_ppo at "
            "auto or set it true (clip against the proximal policy, weight by "
            "min(π_prox/π_behaviour, algo.tis_cap)), algo.tis=token|sequence|mask_token|mask_sequence, or "
            "algo.policy_loss=cispo (see docs/algorithms.md)"]
