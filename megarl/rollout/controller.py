"""The SortedRL controller: oversubscribed, length-aware rollout with early termination.

Pure Python: it imports neither vLLM nor torch.distributed, and drives any
``SlotEngine`` (the real vLLM engine or the discrete-event simulator).

Pipeline of one phase (one policy version)::

    prompt source ──► admit (held/buffered groups first, then re-queued, then new):
                           │   at least `rollout_groups` groups live, and more while a
                           │   free slot has no runnable sample (≤ `buffer_samples`)
                           ▼
                  shared pull queue of samples ──► K engines × S slots
                           ▲   (resumed, then re-queued      │ continuous batching
                           │    longest first, then new)     ▼
                           │                         token events per step
                           │                                    │
                  partial buffer ◄── early termination ◄── harvest: a group is
                  (partial mode)     (U useful groups      released whole when its
                                      released, never       G samples are done, scored,
                                      more than M)          filtered → update batch in
                                                            completion order (short first)

The update-batch contract: a phase releases U = ``update_groups`` useful groups
and never more than M = ``max_update_groups`` (default U), in every mode. A group
that completes past the bound is held whole for the next phase (partial) or
discarded and re-queued (on-policy: its tokens are counted as waste).

On-policy starvation guard (a prompt discarded ``max_discards`` times), one of:

- long rounds (``long_rounds``, the default; RollPacker's tail batching): it waits in
  a long-prompt queue; once that holds ``long_round_groups`` prompts (default U; or its
  oldest was first admitted ``LONG_WAIT`` phases ago, or the source is dry) the next phase
  is a long round: those prompts (topped up to U with new ones) run to completion with no
  early termination, their samples placed on the engines longest first, each on the
  engine with the least known long work (LPT: the phase lasts as long as its slowest
  engine);
- drain (``long_rounds=False``): the next phase pins it — admitted and dispatched
  first, with a reserved place in the batch; once the other groups fill the rest,
  admission stops, the unpinned samples are aborted, and the phase drains the pinned
  ones (its cost: the bubble while draining, ``drain_s``).

Lifecycle of a sample::

    queued ──► running ──► finished (EOS) | truncated (length cap) ──► consumed
                  │
                  └─ phase ends ─► on-policy: discarded, prompt re-queued (tokens wasted)
                                   partial:   resumed (tokens, behaviour logprobs and
                                              per-token versions kept) ──► running …

Worked example (partial mode, G = 2, U = 1 group, k = 1): prompt A's samples need
3 and 9 tokens, prompt B's 2 and 2. Phase v0: A0, A1, B0, B1 run; B's group is done
after 2 steps and released; the phase ends (U reached). A0 has 2 tokens, A1 2: both
are aborted and kept as *resumed* with versions [0, 0]. The trainer updates to v1.
Phase v1 resubmits A0 = prompt + 2 tokens with 1 token left and A1 with 7 left,
before any new prompt. A0's 3 tokens have versions [0, 0, 1]; staleness at
release is 1 ≤ k, so A trains with its per-token behaviour logprobs.

Invariants (each is tested):
1. No prompt is lost or duplicated: every admitted prompt is, at any time, in
   exactly one of {live groups, re-queued, long queue, released}.
2. A group is released whole: all G samples finished or truncated.
3. Staleness ≤ k: every trained token was sampled at most k versions before the
   version that trains it; on-policy mode trains only tokens of the current version.
4. Behaviour logprobs and versions are kept per token across resumes.
5. Deterministic: the same inputs and engine give the same schedule (with environments, ``turns.py``, it also
   depends on when their answers arrive).
6. A phase releases at most M useful groups, and U unless the source runs dry.
7. Multi-turn: a sample waiting on its environment holds no engine slot; every turn it takes is answered once
   (a message appended, or its episode ended) before it runs again.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

from megarl.engines.protocol import SlotEngine
from megarl.rollout.admission import LONG_WAIT, PromptBuffer, PromptItem
from megarl.rollout.phase import STALL_STEPS, EngineStalled, Phase
from megarl.rollout.phase_metrics import PhaseMetrics
from megarl.rollout.turns import Episodes
from megarl.types import Group, SampleStatus

__all__ = ["LONG_WAIT", "MODES", "STALL_STEPS", "ControllerConfig", "EngineStalled", "PromptItem", "RolloutController"]
MODES = ("sync", "on_policy", "partial")
@dataclass
class ControllerConfig:
    mode: str = "partial"
    group_size: int = 8
    update_groups: int = 32  # U: useful groups that end a phase (the update batch)
    rollout_groups: int = 64  # groups kept live at least (oversubscription); sync uses U
    max_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    staleness_limit: int = 1  # k (partial mode)
    stale_action: str = "regenerate"  # 'regenerate' the stale sample | 'drop' its group and re-queue the prompt
    max_discards: int = 2  # on-policy: after this many discards a prompt is pinned (or sent to a long round)
    token_budget: int = 0  # also end a phase after this many generated tokens (0: off)
    release_cap: int = 0  # dynamic sampling: also end once this many groups were released, useful or not (0: off)
    dispatch: str = "pull"  # 'pull' (FIFO) | 'lpt' (longest first, when lengths are known)
    max_update_groups: int = 0  # M: the most useful groups one phase releases (0: U)
    long_rounds: bool = True  # on-policy: tail batching (long rounds); False: the drain guard (other modes: unused)
    buffer_samples: int = 0  # unfinished samples live at most when admitting for free slots (0: no bound)
    # on-policy long rounds: long-queue prompts per round, topped up to U with new ones (0: U)
    long_round_groups: int = 0

    @property
    def batch_bound(self) -> int:
        return self.max_update_groups or self.update_groups

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"rollout mode {self.mode!r} is not one of {MODES}")
        if self.stale_action not in ("regenerate", "drop"):
            raise ValueError(f"stale_action must be 'regenerate' or 'drop', got {self.stale_action!r}")
        if self.dispatch not in ("pull", "lpt"):
            raise ValueError(f"dispatch must be 'pull' or 'lpt', got {self.dispatch!r}")
        if self.mode != "sync" and self.rollout_groups < self.update_groups:
            raise ValueError(f"rollout_groups ({self.rollout_groups}) must be >= update_groups ({self.update_groups})")
        if self.max_update_groups and self.max_update_groups < self.update_groups:
            raise ValueError(f"max_update_groups ({self.max_update_groups}) must be 0 (= update_groups) or >= "
                             f"update_groups ({self.update_groups})")
        if self.long_round_groups < 0:
            raise ValueError(f"long_round_groups must be >= 0 (0: update_groups), got {self.long_round_groups}")
        if self.buffer_samples < 0 or self.max_discards < 1:
            raise ValueError(f"buffer_samples must be >= 0 and max_discards >= 1, got {self.buffer_samples} and "
                             f"{self.max_discards}")


class RolloutController(PromptBuffer):
    """Runs generation phases over engines; returns released groups in completion order."""

    def __init__(self, cfg: ControllerConfig, engines: list[SlotEngine], next_prompt: Callable[[], PromptItem | None],
                 score: Callable[[Group], None] | None = None, keep_group: Callable[[Group], bool] | None = None,
                 batch_order: Callable[[list[Group]], list[Group]] | None = None,
                 engine_turn: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 on_engine_step: Callable[[int, float, float], None] | None = None,
                 engine_version: Callable[[float], int] | None = None, episodes: Episodes | None = None,
                 lock: threading.RLock | None = None) -> None:
        """``score`` fills in a released group's rewards; ``keep_group`` (dynamic sampling) says whether it is
        useful; ``batch_order`` orders the update batch (selective batching). ``engine_turn``: a context each engine
        step runs inside (the pipeline's gate, so an in-flight weight sync comes between two steps);
        ``on_engine_step(engine, start, end)``: told of each step (the timeline); ``engine_version(now)``: the
        weight version the engines hold at a phase's engine time under overlap (None: the phase's own), which
        partial admission keeps within the staleness bound (``Phase.room``); ``episodes``: the samples'
        environments (multi-turn, ``turns.py``; None: single-turn); ``lock``: the state lock (``PromptBuffer``'s),
        shared with the pipeline whose queue a checkpoint takes with this state (``Pipeline.lock``)."""
        cfg.validate()
        super().__init__(cfg, next_prompt)
        self.lock = lock or self.lock
        self.engines = engines
        self.score = score or (lambda group: None)
        self.keep_group = keep_group or (lambda group: True)
        self.batch_order = batch_order or (lambda groups: groups)
        self.engine_turn, self.on_engine_step, self.engine_version = engine_turn, on_engine_step, engine_version
        self.episodes = episodes
        if episodes is not None:
            episodes.lock = self.lock  # (a checkpoint sees the samples and their environments' instances at once)
        self.phase_seed: int | None = None  # engines that take a seed (replicas) are reseeded by each phase with it
        self.interrupt: Callable[[], str] = lambda: ""  # a preemption's signal name: the phase stops between steps

    def _state(self) -> dict:
        """``PromptBuffer``'s, with the episodes' instances (multi-turn)."""
        state = super()._state()
        if self.episodes is not None:
            state["episodes"] = self.episodes.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.episodes is not None:
            self.episodes.load_state_dict(state.get("episodes", {}))

    def close(self) -> None:
        """What the controller started beside the engines ends: the environments' workers (multi-turn)."""
        if self.episodes is not None:
            self.episodes.close()

    def waiting(self) -> int:
        """Samples waiting on their environment's answer."""
        return self.episodes.pending() if self.episodes is not None else 0

    # ---- one phase ---------------------------------------------------------------------
    def run_phase(self, version: int) -> tuple[list[Group], PhaseMetrics]:
        """Generate until the termination threshold; return the update batch and the phase's metrics."""
        return Phase(self, version).run()

    def generate(self, version: int) -> tuple[list[Group], PhaseMetrics]:
        """This rank's phase, shared with no other rank (``LeaderController``'s differs; here the same)."""
        return self.run_phase(version)

    def harvest(self, index: int, version: int, released: list[Group], m: PhaseMetrics, pinned: set[int],
                 members: set[int] | None, pending_pinned: Callable[[], int]) -> None:
        """A group is complete: release it, unless that would pass the bound (places reserved for pinned groups)."""
        cfg = self.cfg
        if cfg.mode == "sync" or members is not None or index in pinned or \
                len(released) + pending_pinned() < cfg.batch_bound:
            self.release(index, version, released, m)
            return
        m.groups_over_bound += 1
        if cfg.mode == "partial":
            return  # held whole, released first in the next phase (its staleness checked then)
        with self.lock:
            g = self.live.pop(index)  # on-policy: its tokens are of this version only; discarded, re-queued
            m.tokens_wasted += sum(s.model_tokens for s in g.samples)
            self.forget_time(index)
            if g.item.key is not None:
                self.length_cache[g.item.key] = sum(s.model_tokens for s in g.samples) / len(g.samples)
            self.requeued.appendleft((g.item, g.discards, g.admitted_version))

    def release(self, index: int, version: int, released: list[Group], m: PhaseMetrics) -> None:
        """Group ``index`` leaves the live set for the batch: scored (without the lock: a checkpoint taken meanwhile
        finds it among the phase's released groups, ``in_phase``), then kept, or filtered out (dynamic sampling)."""
        with self.lock:
            g = self.live.pop(index)
            self.released.add(index)
            self.progress.pop(index, None)
            self.in_phase[index] = g
        group = Group(index, g.item.prompt_text, g.item.answer, g.samples, g.item.extras)
        self.score(group)
        with self.lock:
            lengths = [s.model_tokens for s in g.samples]  # (a trajectory's environment tokens are not the model's)
            self.learn(g.item, g.samples)
            times = [self.slot_time[(index, j)] for j in range(len(g.samples))]
            self.forget_time(index)
            if not self.keep_group(group):
                del self.in_phase[index]
                m.groups_filtered += 1
                m.tokens_wasted += sum(lengths)
                return
            for s, spent in zip(g.samples, times):
                s.status = SampleStatus.CONSUMED
                for v, n in collections.Counter(s.model_versions()).items():  # (the environment's are not trained)
                    m.staleness[version - v] += n
                m.interruptions += s.interruptions
                m.slot_time_useful += spent
                m.turns_sum += s.turns
                m.turns_max = max(m.turns_max, s.turns)
                m.env_tokens += s.env_tokens
                m.env_errors += bool(s.env_error)
            m.samples_trained += len(g.samples)
            m.groups_trained += 1
            m.tokens_useful += sum(lengths)
            m.len_trained_sum += sum(lengths)
            m.wait_phases_max = max(m.wait_phases_max, version - g.admitted_version)
            released.append(group)

    def end_phase(self, running: dict, engine_of: dict, m: PhaseMetrics, released: int = 1) -> None:
        """Abort what is still running: keep it (partial) or discard it and re-queue its prompt (on-policy). An
        on-policy phase that ``released`` nothing keeps it too: no update follows, so its tokens stay on policy."""
        by_engine: dict[int, list[str]] = collections.defaultdict(list)
        for rid in running:
            by_engine[engine_of[rid]].append(rid)
        for k, rids in sorted(by_engine.items()):
            self.engines[k].abort(rids)
        for index, j in running.values():
            self.live[index].samples[j].status = SampleStatus.RESUMED
        if self.cfg.mode != "on_policy" or not released:
            return
        discarded, long = [], []
        for index in list(self.live):
            g = self.live[index]
            reached = max(s.model_tokens for s in g.samples)
            if reached == 0:
                continue  # never started: stays admitted, nothing was spent on it
            m.tokens_wasted += sum(s.model_tokens for s in g.samples)
            del self.live[index]
            self.forget_time(index)
            self.progress[index] = max(self.progress.get(index, 0), reached)
            entry = (g.item, g.discards + 1, g.admitted_version)
            (long if self.cfg.long_rounds and entry[1] >= self.cfg.max_discards else discarded).append(entry)
        # first in the next phase: prompts due for pinning, then the others, each in their order
        discarded.sort(key=lambda e: e[1] < self.cfg.max_discards)
        self.requeued.extendleft(reversed(discarded))
        self.long_queue.extend(long)

