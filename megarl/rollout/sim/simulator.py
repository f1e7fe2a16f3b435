"""Drive the real ``RolloutController`` over simulated engines with a trace of sample lengths.

A trace is a list of full generation lengths, one per sample; consecutive runs of
G form a group (one prompt). ``simulate`` runs ``steps`` update phases per mode
and reports the controller's own metrics. The prompt stream cycles over the trace
(RL reads its prompts for several epochs), so the length cache that LPT dispatch
uses fills after the first pass.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass

from megarl.rollout.controller import ControllerConfig, PromptItem, RolloutController
from megarl.rollout.phase_metrics import PhaseMetrics
from megarl.rollout.sim.engines import SimulatedEngine, StepTimeModel, Weights


@dataclass
class SimSettings:
    group_size: int = 8
    engines: int = 8
    slots: int = 64
    prompts_per_step: int = 0  # 0: every prompt of the trace in one step
    max_tokens: int = 16384
    step_time_model: str = "batch"
    step_base_s: float = 0.02  # the batch model's seconds per decode step (weights read, latency) ...
    step_per_seq_s: float = 0.0002  # ... and per active sequence (its KV cache): megarl plan's for a layout
    steps: int = 0  # 0: one pass over the trace in sync steps
    oversubscription: float = 2.0  # live groups / update groups, non-sync modes
    staleness_limit: int = 2
    max_discards: int = 2
    dispatch: str = "pull"
    long_rounds: bool = True  # on-policy: tail batching (long rounds); False: the drain guard
    buffer_samples: int = 0  # admission budget in unfinished samples (0: every free slot gets a sample)
    max_update_groups: int = 0  # the update-batch bound (0: prompts_per_step)
    long_round_groups: int = 0  # on-policy: long-queue prompts per long round (0: prompts_per_step)
    max_chunk: int = 32  # decode steps one simulated engine step may advance (engines stay this close in time)


def paper_workload(seed: int = 0, prompts: int = 512, group_size: int = 8, cap: int = 16384) -> list[int]:
    """SortedRL-paper-like lengths: 80% of groups ≤ 3K tokens, 15% long (3K–16K), 5% at the 16K cap."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(prompts):
        u = rng.random()
        for _ in range(group_size):
            if u < 0.80:
                lengths.append(rng.randint(100, 3000))
            elif u < 0.95:
                lengths.append(int(3000 + (cap - 3000) * math.sqrt(rng.random())))
            else:
                lengths.append(cap + rng.randint(0, cap))  # would run past the cap: truncated
    return lengths


def lognormal_workload(seed: int = 0, prompts: int = 4096, group_size: int = 8, cap: int = 8192,
                       median: float = 1000.0, sigma: float = 1.0) -> list[int]:
    """Lengths drawn per sample from a lognormal (median ``median`` tokens, shape ``sigma``), some past the cap."""
    rng = random.Random(seed)
    return [max(1, int(rng.lognormvariate(math.log(median), sigma))) for _ in range(prompts * group_size)]


def sync_closed_form(lengths: list[int], batch: int, cap: int) -> float:
    """Bubble of synchronous steps with constant step time and one slot per sample:
    1 − Σ L / (B · L_max) over all batches (slot-time weighted), lengths capped at ``cap``."""
    busy = total = 0
    for i in range(0, len(lengths), batch):
        chunk = [min(x, cap) for x in lengths[i:i + batch]]
        busy += sum(chunk)
        total += batch * max(chunk)
    return 1.0 - busy / total


def on_policy_bubble_floor(at_cap: int, tokens: int, phase_s: float, cap: int, slots: int,
                           model: StepTimeModel) -> float:
    """The least bubble any on-policy schedule can have that trains ``at_cap`` samples of ``cap`` tokens and
    generates ``tokens`` tokens in all, with no phase longer than ``phase_s``, under the ``batch`` step model
    t(a) = b + c·a per decode step with a active sequences (0 under the ``constant`` model).

    On-policy, an at-cap sample runs its ``cap`` decode steps inside one phase. On an engine that runs one, the
    idle slot-time per step, (S − a)(b + c·a), is concave in a and 0 at a = S, so it is ≥ b·(S − a); with
    Σ(b + c·a) ≤ phase_s over those steps, Σa ≤ (phase_s − b·cap)/c, hence idle ≥ cap·(S·b + b²/c) − (b/c)·phase_s.
    The same Σa bound lets one engine finish at most ⌊(phase_s − b·cap)/(c·cap)⌋ at-cap samples in a phase, so at
    least ⌈at_cap / that⌉ engine-phases pay that idle. Busy slot-time is ≤ (b + c·S) per generated token.
    """
    b, c = model.base, model.per_seq if model.kind == "batch" else 0.0
    if not at_cap or not c:
        return 0.0
    per_engine = math.floor((phase_s - b * cap) / (c * cap))
    if per_engine < 1:
        return 1.0  # no phase that short can hold an at-cap sample: infeasible
    idle = math.ceil(at_cap / per_engine) * max(0.0, cap * (slots * b + b * b / c) - (b / c) * phase_s)
    busy = tokens * (b + c * slots)
    return idle / (idle + busy)


class Pipeline:
    """The timeline of generation beside training (megarl/rollout/pipeline.py's), phase by phase: batch b takes
    ``gen_s`` of the engines, then ``train_s`` and a weight sync of ``sync_s`` of the trainer, under
    ``rollout.overlap``:

    - ``none``: they take turns, Σ (gen + train + sync); phase b samples with v_b;
    - ``one_step``: batch b+1 is generated, with v_b, while b trains; the sync waits for both (the phase boundary);
    - ``async``: phases back to back; phase b starts only once step b − k − 1 is done (k = the staleness limit);
      the trainer takes batch b once it is generated and it is free; the engines hold the weights of every step
      whose sync is done by then, and a sync that completes while a phase runs stops its engines for ``sync_s``
      (loaded between two engine steps; ``loads`` counts them per phase). At k = 0 this is ``none``'s timeline.

    ``begin`` gives when the next phase starts, ``version_at`` the engines' weights during it, ``end`` records it.
    """

    def __init__(self, overlap: str, sync_s: float, k: int = 1) -> None:
        if overlap not in ("none", "one_step", "async"):
            raise ValueError(f"overlap must be none, one_step or async, got {overlap!r}")
        self.overlap, self.sync_s, self.k = overlap, sync_s, k
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.loads: list[int] = []  # syncs landing inside each phase (async)
        self.gen: list[float] = []
        self.train: list[float] = []
        self.done: list[float] = []  # when each step's sync is done (async, none); never decreasing

    def begin(self) -> float:
        b, sync = len(self.starts), self.sync_s
        if self.overlap == "none":
            start = self.done[-1] if b else 0.0
        elif self.overlap == "one_step":
            start = 0.0 if b == 0 else self.ends[0] if b == 1 else \
                self.starts[-1] + max(self.train[b - 2], self.gen[b - 1]) + sync
        else:
            start = max(self.ends[-1] if b else 0.0, self.done[b - self.k - 1] if b - self.k - 1 >= 0 else 0.0)
        self.starts.append(start)
        return start

    def version_at(self, t: float) -> int:
        """The weights the engines hold at time ``t`` of the phase begun last (updates done by then)."""
        b = len(self.starts) - 1
        if self.overlap == "none":
            return b
        if self.overlap == "one_step":
            return max(b - 1, 0)
        return bisect.bisect_right(self.done, max(t, self.starts[-1]))  # (asked at every engine step)

    def end(self, gen_s: float, train_s: float) -> None:
        start, loads = self.starts[-1], 0
        end = start + gen_s
        while self.overlap == "async":  # each load inside the phase lengthens it, which may take in the next
            landed = bisect.bisect_right(self.done, end) - bisect.bisect_right(self.done, start)
            if landed == loads:
                break
            loads, end = landed, start + gen_s + landed * self.sync_s
        self.ends.append(end)
        self.loads.append(loads)
        self.gen.append(gen_s)
        self.train.append(train_s)
        trainer = max(self.done[-1] if self.done else 0.0, end)
        self.done.append(trainer + train_s + self.sync_s)

    def wall(self) -> float:
        if not self.gen:
            raise ValueError("no phase: no timeline")
        if self.overlap != "one_step":
            return self.done[-1]
        n = len(self.gen)
        if n == 1:
            return self.gen[0] + self.train[0] + self.sync_s
        return self.starts[-1] + max(self.train[n - 2], self.gen[n - 1]) + self.train[n - 1] + 2 * self.sync_s


def overlap_timeline(gen_s: list[float], train_s: list[float], sync_s: float, overlap: str, k: int = 1) -> Pipeline:
    """The ``Pipeline`` of these phases: ``wall()``, when each phase starts and ends, the loads inside each."""
    p = Pipeline(overlap, sync_s, k)
    for gen, train in zip(gen_s, train_s):
        p.begin()
        p.end(gen, train)
    return p


@dataclass
class TrainerModel:
    """The trainer beside the simulated engines: ``rollout.overlap``, seconds per trained token, seconds per sync."""

    overlap: str
    s_per_token: float
    sync_s: float


def simulate(lengths: list[int], mode: str, s: SimSettings, trainer: TrainerModel | None = None) -> dict:
    """``steps`` phases of the controller in ``mode``; with a ``trainer``, its engines sample with the weights the
    ``Pipeline`` gives them at each moment, so the staleness that overlap adds meets ``s.staleness_limit``."""
    g = s.group_size
    if len(lengths) % g:
        raise ValueError(f"trace has {len(lengths)} lengths, not a multiple of the group size {g}")
    n_prompts = len(lengths) // g
    per_step = s.prompts_per_step or n_prompts
    steps = s.steps or math.ceil(n_prompts / per_step)
    counter = {"next": 0}

    def next_prompt() -> PromptItem | None:
        i = counter["next"]
        if mode == "sync" and i >= steps * per_step and not s.steps:
            return None
        counter["next"] += 1
        return PromptItem(index=i, prompt_ids=[1], key=i % n_prompts)

    def length_of(key: tuple[int, int]) -> int:
        index, j = key
        return lengths[(index % n_prompts) * g + j]

    cfg = ControllerConfig(
        mode=mode, group_size=g, update_groups=per_step,
        rollout_groups=per_step if mode == "sync" else max(per_step, int(round(per_step * s.oversubscription))),
        max_tokens=s.max_tokens, staleness_limit=s.staleness_limit, max_discards=s.max_discards, dispatch=s.dispatch,
        long_rounds=s.long_rounds and mode == "on_policy", buffer_samples=s.buffer_samples,
        max_update_groups=s.max_update_groups, long_round_groups=s.long_round_groups,
    )
    model = StepTimeModel(s.step_time_model, s.step_base_s, s.step_per_seq_s)
    weights = Weights()
    engines = [SimulatedEngine(s.slots, length_of, model, s.max_chunk, weights) for _ in range(s.engines)]
    pipeline = Pipeline(trainer.overlap, trainer.sync_s, s.staleness_limit) if trainer else None
    now = {"start": 0.0, "clock": 0.0}  # engine time t of a phase is wall time start + (t − clock)

    def engine_version(t: float) -> int:
        return pipeline.version_at(now["start"] + (t - now["clock"]))

    ctrl = RolloutController(cfg, engines, next_prompt, engine_version=engine_version if pipeline else None)
    total, batches, phase_s, phase_tokens, at_cap = PhaseMetrics(), [], [], [], 0
    for version in range(steps):
        if pipeline:
            now.update(start=pipeline.begin(), clock=ctrl.clock)
            weights.start_phase(ctrl.clock, engines, engine_version)
        groups, m = ctrl.run_phase(version)
        if pipeline:
            pipeline.end(m.duration, trainer.s_per_token * m.len_trained_sum)
        total.merge(m)
        at_cap += sum(x.finish_reason == "length" for g in groups for x in g.samples)
        batches.append(len(groups))
        phase_s.append(m.duration)
        phase_tokens.append(m.len_trained_sum)
        if not groups and ctrl.source_done and not ctrl.live:
            break
    out = {"mode": mode, "guard": ("long_rounds" if cfg.long_rounds else "drain") if mode == "on_policy" else "",
           "overlap": trainer.overlap if trainer else "",
           "trainer": (trainer.overlap, trainer.s_per_token, trainer.sync_s, s.staleness_limit) if trainer else None,
           **{k.split("/", 1)[1]: v for k, v in total.summary().items()}}
    out.update(steps=steps, samples_trained=total.samples_trained, at_cap_samples_trained=at_cap,
               tokens_generated=total.tokens_generated, sim_seconds=total.duration,
               groups_per_step_mean=sum(batches) / len(batches), groups_per_step_max=max(batches),
               groups_per_step_min=min(batches), phase_s_mean=sum(phase_s) / len(phase_s), phase_s_max=max(phase_s),
               groups_per_step=batches, phase_s=[round(x, 1) for x in phase_s], phase_s_exact=phase_s,
               phase_trained_tokens=phase_tokens,
               slot_s_busy=total.slot_time_busy, slot_capacity=s.engines * s.slots)
    return out


def with_trainer(out: dict, overlap: str, train_s_per_token: float, sync_s: float, k: int) -> dict:
    """A ``simulate`` result with the trainer and the sync modelled (``overlap_timeline``): end-to-end wall time,
    trained samples per second, the engines' and the trainer's utilisation, and where the engines' idle time goes,
    as shares of their slot-time over the run (``engine_idle_*``, which with the utilisation sum to 1):

    - ``bubble``: idle slots inside generation phases (the tail SortedRL's modes cut);
    - ``between_phases``: the engines stopped between two phases (training under ``none``, the phase boundary under
      ``one_step``, waiting on the staleness bound under ``async``);
    - ``sync``: the weight loads that land inside ``async`` phases;
    - ``run_end``: after the last phase (the trainer training what is left, a finite run's end that shrinks as
      1/steps; under ``one_step`` the last boundary too); ``engine_utilisation_to_last_phase`` leaves it out.

    An overlapped ``out`` must come from ``simulate`` with the same ``TrainerModel`` and k (its engines sampled with
    the weights this timeline gives them); a run without one stands for ``none`` only.
    """
    if overlap != "none" and out["trainer"] != (overlap, train_s_per_token, sync_s, k):
        raise ValueError(f"a run simulated with trainer {out['trainer']} timed as "
                         f"{(overlap, train_s_per_token, sync_s, k)}"
                         ": simulate it with TrainerModel(overlap, train_s_per_token, sync_s) and that staleness limit")
    gen = out["phase_s_exact"]
    train = [train_s_per_token * t for t in out["phase_trained_tokens"]]
    p = overlap_timeline(gen, train, sync_s, overlap, k)
    wall, last = p.wall(), p.ends[-1]
    busy = out["slot_s_busy"] / out["slot_capacity"]  # seconds of all slots busy
    in_phases = sum(gen)
    loads = sum(p.loads) * sync_s
    return {"mode": out["mode"], "guard": out["guard"], "overlap": overlap, "wall_s": wall,
            "samples_per_s": out["samples_trained"] / wall, "engine_utilisation": busy / wall,
            "engine_utilisation_to_last_phase": busy / last,
            "engine_idle_bubble": (in_phases - busy) / wall, "engine_idle_sync": loads / wall,
            "engine_idle_between_phases": max(0.0, last - in_phases - loads) / wall,  # (max: float rounding)
            "engine_idle_run_end": (wall - last) / wall,
            "trainer_utilisation": sum(train) / wall, "train_share_of_step": sum(train) / (sum(gen) + sum(train)),
            "wasted_token_fraction": out["wasted_token_fraction"], "staleness_mean": out["staleness_mean"],
            "staleness_max": out["staleness_max"]}
