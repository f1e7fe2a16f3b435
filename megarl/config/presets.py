"""Algorithm presets: named defaults for ``algo.*`` keys, each from its paper.

A preset applies where it is given. The layers are the YAML file, then each
command-line override; a layer that sets ``algo.preset`` starts the ``algo``
section afresh (defaults, then the preset), so the algo keys of earlier layers
are replaced (``megarl demo algo.preset=ppo`` runs PPO although configs/demo.yaml
sets GRPO's keys), and algo keys of the same or a later layer win over the
preset (``algo.preset=dapo algo.clip_high=0.3``). What an override replaced is
said by the caller's ``say`` (the CLI: once per job). The README's algorithm table is generated from the same facts.
"""

from __future__ import annotations

from collections.abc import Callable

from megarl.config.errors import ConfigError
from megarl.config.schema import AlgoConfig, RunConfig

PRESETS: dict[str, dict] = {
    # Shao et al. 2024 (DeepSeekMath): group-normalised advantages, sequence-mean of token means.
    "grpo": {"advantage": "grpo", "policy_loss": "ppo", "loss_agg": "seq_mean_token_mean", "clip_low": 0.2,
             "clip_high": 0.2},
    # Liu et al. 2025 (Understanding R1-Zero-like training): no std scaling, constant normaliser.
    "dr_grpo": {"advantage": "dr_grpo", "policy_loss": "ppo", "loss_agg": "seq_mean_token_sum_norm",
                "clip_low": 0.2, "clip_high": 0.2},
    # Ahmadian et al. 2024 (Back to basics): leave-one-out baseline.
    "rloo": {"advantage": "rloo", "policy_loss": "ppo", "loss_agg": "token_mean"},
    # Yu et al. 2025 (DAPO): clip-higher, token-level loss, dynamic sampling, over-long shaping over the last 20% of
    # the length cap (the paper's 4,096 of 20,480 tokens).
    "dapo": {"advantage": "grpo", "policy_loss": "ppo", "loss_agg": "token_mean", "clip_low": 0.2,
             "clip_high": 0.28, "dynamic_sampling": True, "overlong_filter": False,
             "overlong_cache_frac": 0.2, "overlong_penalty": 1.0},
    # Zheng et al. 2025 (GSPO): sequence-level length-normalised ratio with a tight clip range.
    "gspo": {"advantage": "grpo", "policy_loss": "gspo", "loss_agg": "seq_mean_token_mean", "clip_low": 3e-4,
             "clip_high": 4e-4},
    # Chen et al. 2025 (MiniMax-M1): CISPO, the clipped importance weight detached on −Â·log π (no token loses its
    # gradient), no lower bound (ε_low = 1), token-level loss, group advantages. MiniMax tunes ε_high: 4 (weight ≤ 5)
    # is torchtitan's CISPO default.
    "cispo": {"advantage": "grpo", "policy_loss": "cispo", "loss_agg": "token_mean", "clip_low": 1.0,
              "clip_high": 4.0},
    # Schulman et al. 2017 / Ouyang et al. 2022: critic, GAE, clipped value loss, KL to the reference (a k3 loss
    # term, as GRPO puts it; InstructGPT penalises the reward instead).
    # λ = 0.95 for the policy's advantages and the critic's value targets alike (VAPO decouples them).
    "ppo": {"advantage": "gae", "policy_loss": "ppo", "loss_agg": "token_mean", "gamma": 1.0, "lam": 0.95,
            "lam_critic": 0.95, "whiten_advantages": True, "value_clip": 0.2, "kl_coef": 0.001, "kl_estimator": "k3"},
    # Yue et al. 2025 (VAPO): decoupled λ, length-adaptive λ, value pre-training, clip-higher,
    # token-level loss, positive-example LM loss.
    "vapo": {"advantage": "gae", "policy_loss": "ppo", "loss_agg": "token_mean", "lam_critic": 1.0,
             "length_adaptive_alpha": 0.05, "clip_low": 0.2, "clip_high": 0.28, "critic_warmup_steps": 2,
             "positive_nll_coef": 0.1, "value_clip": 0.2, "whiten_advantages": True},
}


Layer = tuple[object, str]  # (parsed YAML mapping, where it came from: the file or "override '...'")


def apply_layers(cfg: RunConfig, layers: list[Layer], apply: Callable[[object, object, str], None],
                 say: Callable[[str], None] | None = None) -> RunConfig:
    """Apply ``layers`` in order with ``apply`` (the loader's strict mapper); a layer's ``algo.preset`` first resets
    ``cfg.algo`` to the defaults and that preset. The algo keys of earlier layers it drops are told to ``say``."""
    earlier: list[tuple[str, object, str]] = []  # (algo key, value, source) of the layers applied so far
    for layer, source in layers:
        algo = layer.get("algo") if isinstance(layer, dict) else None
        algo = algo if isinstance(algo, dict) else {}
        name = algo.get("preset", "")
        if name != "":
            if not isinstance(name, str) or name not in PRESETS:
                raise ConfigError(f"{source}: algo.preset {name!r} is not known; valid: {', '.join(PRESETS)}")
            replaced = [(k, v, src) for k, v, src in earlier if k not in algo]
            cfg.algo = AlgoConfig()
            apply(cfg, {"algo": PRESETS[name]}, f"preset {name!r}")
            if replaced and say is not None:
                say(f"megarl: algo.preset={name} ({source}) replaces the algo keys set before it: "
                     + ", ".join(f"algo.{k}={v} ({src})" for k, v, src in replaced)
                     + "; give them after the preset to keep them")
            earlier = []
        apply(cfg, layer, source)
        earlier += [(k, v, source) for k, v in algo.items()]
    return cfg

