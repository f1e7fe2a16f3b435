"""Algorithm presets: named defaults for ``algo.*`` keys, each from its paper.

A preset is applied before the YAML file and the overrides, so anything set
explicitly wins. The README's algorithm table is generated from the same facts.
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # Shao et al. 2024 (DeepSeekMath): group-normalised advantages, sequence-mean of token means.
    "grpo": {"advantage": "grpo", "policy_loss": "ppo", "loss_agg": "seq_mean_token_mean", "clip_low": 0.2,
             "clip_high": 0.2},
    # Liu et al. 2025 (Understanding R1-Zero-like training): no std scaling, constant normaliser.
    "dr_grpo": {"advantage": "dr_grpo", "policy_loss": "ppo", "loss_agg": "seq_mean_token_sum_norm",
                "clip_low": 0.2, "clip_high": 0.2},
    # Ahmadian et al. 2024 (Back to basics): leave-one-out baseline.
    "rloo": {"advantage": "rloo", "policy_loss": "ppo", "loss_agg": "token_mean"},
    # Yu et al. 2025 (DAPO): clip-higher, token-level loss, dynamic sampling, over-long shaping.
    "dapo": {"advantage": "grpo", "policy_loss": "ppo", "loss_agg": "token_mean", "clip_low": 0.2,
             "clip_high": 0.28, "dynamic_sampling": True, "overlong_filter": False, "overlong_cache": 16,
             "overlong_penalty": 1.0},
    # Zheng et al. 2025 (GSPO): sequence-level length-normalised ratio with a tight clip range.
    "gspo": {"advantage": "grpo", "policy_loss": "gspo", "loss_agg": "seq_mean_token_mean", "clip_low": 3e-4,
             "clip_high": 4e-4},
    # Schulman et al. 2017 / Ouyang et al. 2022: critic, GAE, clipped value loss, KL to the reference.
    "ppo": {"advantage": "gae", "policy_loss": "ppo", "loss_agg": "token_mean", "gamma": 1.0, "lam": 0.95,
            "whiten_advantages": True, "value_clip": 0.2, "kl_coef": 0.001, "kl_estimator": "k3"},
    # Yue et al. 2025 (VAPO): decoupled λ, length-adaptive λ, value pre-training, clip-higher,
    # token-level loss, positive-example LM loss.
    "vapo": {"advantage": "gae", "policy_loss": "ppo", "loss_agg": "token_mean", "lam_critic": 1.0,
             "length_adaptive_alpha": 0.05, "clip_low": 0.2, "clip_high": 0.28, "critic_warmup_steps": 2,
             "positive_nll_coef": 0.1, "value_clip": 0.2, "whiten_advantages": True},
}
