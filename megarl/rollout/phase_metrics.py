"""Per-phase rollout metrics: the bubble ratio and the numbers that keep it honest.

- bubble ratio = idle slot-time / total slot-time of the engines in the phase;
- η_gen = slot-time spent on tokens that reach the loss / total slot-time (partial mode credits a released
  sample's whole generation, earlier phases included, to the releasing phase: one phase can show > 1, the sum
  over a run's phases is exact);
- wasted tokens = generated, then thrown away (discarded on-policy samples,
  stale partial samples, groups dropped by dynamic sampling);
- useful tokens = tokens of the samples handed to the trainer;
- tokens/s and useful tokens/s = those tokens over the phase's engine time, only for a phase that
  generated tokens: a partial-mode phase that only releases groups held whole from the last phase
  runs no engine step (duration 0), and a rate over no time is no rate, so the keys are left out;
- groups released = the update batch (useful groups handed to the trainer);
- wait phases = phases from a prompt's first admission to its release (starvation).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class PhaseMetrics:
    duration: float = 0.0
    slot_time_total: float = 0.0
    slot_time_busy: float = 0.0
    slot_time_useful: float = 0.0
    tokens_generated: int = 0
    tokens_useful: int = 0
    tokens_wasted: int = 0
    samples_trained: int = 0
    groups_trained: int = 0
    groups_filtered: int = 0
    len_trained_sum: int = 0
    len_finished_sum: int = 0
    samples_finished: int = 0
    interruptions: int = 0
    staleness: Counter = field(default_factory=Counter)  # versions behind → trained tokens
    sampled_versions: Counter = field(default_factory=Counter)  # engine weight version → tokens sampled in the phase
    buffer_groups: int = 0
    prompts_discarded_twice: int = 0
    groups_over_bound: int = 0  # completed past the update-batch bound: held (partial) or discarded (on-policy)
    long_rounds: int = 0  # phases run as a long round (on-policy tail batching)
    drain_s: float = 0.0  # time spent draining pinned groups with admission stopped (on-policy guard)
    wait_phases_max: int = 0  # most phases between a trained prompt's first admission and its release
    samples_regenerated_at_release: int = 0  # finished past the staleness bound (engines behind): run again
    multi_turn: bool = False  # samples have environments (``env.fn``): the turn metrics are reported
    turns_sum: int = 0  # model turns of the trained samples
    turns_max: int = 0
    env_tokens: int = 0  # environment tokens of the trained trajectories (loss mask 0)
    tool_calls: int = 0  # environment calls (`step`) the phase made
    env_errors: int = 0  # trained samples whose episode an environment failure ended

    @property
    def bubble_ratio(self) -> float:
        return 1.0 - self.slot_time_busy / self.slot_time_total if self.slot_time_total else 0.0

    @property
    def eta_gen(self) -> float:
        return self.slot_time_useful / self.slot_time_total if self.slot_time_total else 0.0

    def merge(self, other: "PhaseMetrics") -> None:
        for name in self.__dataclass_fields__:
            if name in ("staleness", "sampled_versions"):
                getattr(self, name).update(getattr(other, name))
            elif name in ("buffer_groups", "prompts_discarded_twice"):  # snapshots, not sums
                setattr(self, name, getattr(other, name))
            elif name in ("wait_phases_max", "turns_max", "multi_turn"):
                setattr(self, name, max(getattr(self, name), getattr(other, name)))
            else:
                setattr(self, name, getattr(self, name) + getattr(other, name))

    def summary(self) -> dict[str, float]:
        """Scalars under stable TensorBoard names (``rollout/...``); the two rates only when tokens were generated."""
        total_stale = sum(self.staleness.values()) or 1
        rates = {}
        if self.tokens_generated and self.duration > 0:  # no engine step, no time: no rate (module docstring)
            rates = {"rollout/tokens_per_s": self.tokens_generated / self.duration,
                     "rollout/useful_tokens_per_s": self.tokens_useful / self.duration}
        out = {
            "rollout/bubble_ratio": self.bubble_ratio,
            "rollout/eta_gen": self.eta_gen,
            **rates,
            "rollout/wasted_token_fraction": self.tokens_wasted / max(self.tokens_generated, 1),
            "rollout/interruptions_per_sample": self.interruptions / max(self.samples_trained, 1),
            "rollout/len_trained_mean": self.len_trained_sum / max(self.samples_trained, 1),
            "rollout/len_generated_mean": self.len_finished_sum / max(self.samples_finished, 1),
            "rollout/buffer_groups": float(self.buffer_groups),
            "rollout/prompts_discarded_twice": float(self.prompts_discarded_twice),
            "rollout/groups_filtered": float(self.groups_filtered),
            "rollout/groups_released": float(self.groups_trained),
            "rollout/groups_over_bound": float(self.groups_over_bound),
            "rollout/long_rounds": float(self.long_rounds),
            "rollout/drain_s": self.drain_s,
            "rollout/wait_phases_max": float(self.wait_phases_max),
            "rollout/stale_at_release": float(self.samples_regenerated_at_release),
            "rollout/staleness_mean": sum(k * v for k, v in self.staleness.items()) / total_stale,
            "rollout/staleness_max": float(max(self.staleness, default=0)),
            # >1: the engines' weights moved while the phase ran (rollout.overlap=async's in-flight loads)
            "rollout/phase_versions": float(len(self.sampled_versions)),
        }
        if self.multi_turn:
            out.update({
                "rollout/turns_mean": self.turns_sum / max(self.samples_trained, 1),
                "rollout/turns_max": float(self.turns_max),
                "rollout/tool_calls": float(self.tool_calls),
                "rollout/env_errors": float(self.env_errors),
                # of the trained trajectories' tokens (prompts aside): the environment's share
                "rollout/env_token_fraction": self.env_tokens / max(self.env_tokens + self.len_trained_sum, 1),
            })
        return out
