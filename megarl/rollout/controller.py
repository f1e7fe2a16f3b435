"""The SortedRL controller: oversubscribed, length-aware rollout with early termination.

Pure Python: it imports neither vLLM nor torch.distributed, and drives any
``SlotEngine`` (the real vLLM engine or the discrete-event simulator).

Pipeline of one phase (one policy version)::

    prompt source ──► admit (buffered groups first, then re-queued, then new)
                           │   keep `rollout_groups` groups live (oversubscription)
                           ▼
                  shared pull queue of samples ──► K engines × S slots
                           ▲   (a freed slot pulls at once;     │ continuous batching
                           │    LPT order when lengths known)   ▼
                           │                         token events per step
                           │                                    │
                  partial buffer ◄── early termination ◄── harvest: a group is
                  (partial mode)     (U useful groups      released whole when its
                                      released, or a        G samples are done, scored,
                                      token budget)         filtered → update batch in
                                                            completion order (short first)

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
   exactly one of {live groups, re-queued, released}.
2. A group is released whole: all G samples finished or truncated.
3. Staleness ≤ k: every trained token was sampled at most k versions before the
   version that trains it; on-policy mode trains only tokens of the current version.
4. Behaviour logprobs and versions are kept per token across resumes.
5. Deterministic: the same inputs and engine give the same schedule.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from megarl.rollout.engine_api import SlotEngine, SlotRequest, StepReport
from megarl.rollout.phase_metrics import PhaseMetrics
from megarl.types import Group, Sample, SampleStatus

MODES = ("sync", "on_policy", "partial")


@dataclass
class PromptItem:
    """A prompt from the source: a stable index, its tokens, and what the reward needs."""

    index: int
    prompt_ids: list[int]
    prompt_text: str = ""
    answer: str = ""
    key: object = None  # identity for the length cache (same prompt in a later epoch)


@dataclass
class ControllerConfig:
    mode: str = "partial"
    group_size: int = 8
    update_groups: int = 32  # U: useful groups that end a phase (the update batch)
    rollout_groups: int = 64  # groups kept live (oversubscription); sync uses U
    max_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    staleness_limit: int = 1  # k (partial mode)
    stale_action: str = "regenerate"  # 'regenerate' the stale sample | 'drop' its group and re-queue the prompt
    max_discards: int = 2  # on-policy: after this many discards a prompt is protected from early termination
    token_budget: int = 0  # also end a phase after this many generated tokens (0: off)
    release_cap: int = 0  # dynamic sampling: also end once this many groups were released, useful or not (0: off)
    dispatch: str = "pull"  # 'pull' (FIFO) | 'lpt' (longest first, when lengths are known)

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"rollout mode {self.mode!r} is not one of {MODES}")
        if self.stale_action not in ("regenerate", "drop"):
            raise ValueError(f"stale_action must be 'regenerate' or 'drop', got {self.stale_action!r}")
        if self.dispatch not in ("pull", "lpt"):
            raise ValueError(f"dispatch must be 'pull' or 'lpt', got {self.dispatch!r}")
        if self.mode != "sync" and self.rollout_groups < self.update_groups:
            raise ValueError(f"rollout_groups ({self.rollout_groups}) must be >= update_groups ({self.update_groups})")


@dataclass
class _Live:
    """A group in flight: its samples, its prompt, and how often it was discarded."""

    item: PromptItem
    samples: list[Sample]
    discards: int = 0
    admitted_version: int = 0


class RolloutController:
    """Runs generation phases over engines; returns released groups in completion order."""

    def __init__(self, cfg: ControllerConfig, engines: list[SlotEngine], next_prompt: Callable[[], PromptItem | None],
                 score: Callable[[Group], None] | None = None, keep_group: Callable[[Group], bool] | None = None,
                 batch_order: Callable[[list[Group]], list[Group]] | None = None) -> None:
        cfg.validate()
        self.cfg, self.engines = cfg, engines
        self.next_prompt = next_prompt
        self.score = score or (lambda group: None)
        self.keep_group = keep_group or (lambda group: True)  # dynamic sampling hook
        self.batch_order = batch_order or (lambda groups: groups)  # selective batching hook
        self.live: dict[int, _Live] = {}  # prompt index → group in flight (or buffered)
        self.requeued: collections.deque[tuple[PromptItem, int]] = collections.deque()  # (item, discards)
        self.length_cache: dict[object, float] = {}  # prompt key → mean generated length
        self.released: set[int] = set()
        self.slot_time: collections.Counter = collections.Counter()  # (index, j) → engine slot-time spent
        self.source_done = False
        self.clock = 0.0  # engine time across phases

    # ---- admission -------------------------------------------------------------------
    def _new_group(self, item: PromptItem, version: int, discards: int = 0) -> None:
        if item.index in self.live or item.index in self.released:
            raise RuntimeError(f"prompt {item.index} admitted twice")
        samples = [Sample(prompt_ids=list(item.prompt_ids)) for _ in range(self.cfg.group_size)]
        self.live[item.index] = _Live(item, samples, discards, version)

    def _admit(self, version: int, target: int | None = None) -> None:
        if target is None:
            target = self.cfg.update_groups if self.cfg.mode == "sync" else self.cfg.rollout_groups
        while len(self.live) < target:
            if self.requeued:
                item, discards = self.requeued.popleft()
                self._new_group(item, version, discards)
                continue
            item = None if self.source_done else self.next_prompt()
            if item is None:
                self.source_done = True
                return
            self._new_group(item, version)

    def _expire_stale(self, version: int, m: PhaseMetrics) -> None:
        """Partial mode: samples whose oldest token is more than k versions old are not resumed."""
        k = self.cfg.staleness_limit
        for index in list(self.live):
            g = self.live[index]
            stale = [j for j, s in enumerate(g.samples) if s.versions and version - min(s.versions) > k]
            if not stale:
                continue
            if self.cfg.stale_action == "drop":
                m.tokens_wasted += sum(len(s.response_ids) for s in g.samples)
                del self.live[index]
                self._forget_time(index)
                self.requeued.appendleft((g.item, g.discards))
                continue
            for j in stale:
                s = g.samples[j]
                m.tokens_wasted += len(s.response_ids)
                self.slot_time.pop((index, j), None)
                s.response_ids, s.logprobs, s.versions = [], [], []
                s.status, s.finish_reason = SampleStatus.QUEUED, ""

    def _queue(self) -> collections.deque[tuple[int, int]]:
        """Samples to run: resumed ones first (buffered groups before new prompts), then by LPT or FIFO."""
        resumed, fresh = [], []
        for index, g in self.live.items():
            for j, s in enumerate(g.samples):
                if s.status in (SampleStatus.QUEUED, SampleStatus.RESUMED):
                    (resumed if s.response_ids else fresh).append((index, j))
        if self.cfg.dispatch == "lpt" and all(self.live[i].item.key in self.length_cache for i, _ in fresh):
            fresh.sort(key=lambda ij: -self.length_cache[self.live[ij[0]].item.key])
        return collections.deque(resumed + fresh)

    # ---- one phase ---------------------------------------------------------------------
    def run_phase(self, version: int) -> tuple[list[Group], PhaseMetrics]:
        """Generate until the termination threshold; return the update batch and the phase's metrics."""
        cfg, m = self.cfg, PhaseMetrics()
        if cfg.mode == "partial":
            self._expire_stale(version, m)
        self._admit(version)
        queue = self._queue()
        running: dict[str, tuple[int, int]] = {}
        engine_of: dict[str, int] = {}
        times = [self.clock] * len(self.engines)
        released: list[Group] = []
        phase_tokens = 0
        serial = 0

        def dispatch(k: int) -> None:
            nonlocal serial
            engine = self.engines[k]
            while queue and engine.num_active() < engine.slots:
                index, j = queue.popleft()
                s = self.live[index].samples[j]
                if s.response_ids:
                    s.interruptions += 1
                s.status = SampleStatus.RUNNING
                serial += 1
                rid = f"{index}:{j}:{serial}"
                engine.submit(SlotRequest(rid, s.prompt_ids + s.response_ids, cfg.max_tokens - len(s.response_ids),
                                          cfg.temperature, cfg.top_p, key=(index, j), generated=len(s.response_ids)))
                running[rid], engine_of[rid] = (index, j), k

        def done() -> bool:
            useful = len(released)
            if cfg.mode == "sync":
                return not self.live
            protected = any(g.discards >= cfg.max_discards for g in self.live.values())
            if protected or useful == 0:
                return False
            if cfg.token_budget and phase_tokens >= cfg.token_budget:
                return True
            if cfg.release_cap and useful + m.groups_filtered >= cfg.release_cap:
                return True  # oversampling cap: train on the useful groups there are
            return useful >= cfg.update_groups

        for k in range(len(self.engines)):
            dispatch(k)
        while running and not done():
            k = min((k for k in range(len(self.engines)) if self.engines[k].num_active()), key=lambda k: times[k])
            report: StepReport = self.engines[k].step()
            times[k] += report.elapsed
            m.slot_time_busy += report.active * report.elapsed
            for ev in report.events:
                index, j = running[ev.request_id]
                s = self.live[index].samples[j]
                s.response_ids += ev.token_ids
                s.logprobs += ev.logprobs
                s.versions += [version] * len(ev.token_ids)
                self.slot_time[(index, j)] += report.elapsed  # it held a slot for the whole step
                phase_tokens += len(ev.token_ids)
                m.tokens_generated += len(ev.token_ids)
                if ev.finished:
                    del running[ev.request_id], engine_of[ev.request_id]
                    s.finish_reason = ev.finish_reason
                    s.status = SampleStatus.FINISHED if ev.finish_reason == "stop" else SampleStatus.TRUNCATED
                    m.samples_finished += 1
                    m.len_finished_sum += len(s.response_ids)
                    if all(x.status in (SampleStatus.FINISHED, SampleStatus.TRUNCATED) for x in self.live[index].samples):
                        self._release(index, version, released, m)
            before = len(self.live)
            if cfg.mode != "sync":
                self._admit(version)
            elif m.groups_filtered and (not cfg.release_cap or len(released) + m.groups_filtered < cfg.release_cap):
                # sync + dynamic sampling: replace each filtered group until U useful ones (or the cap)
                target = cfg.update_groups - len(released)
                if cfg.release_cap:  # never release more than the cap, in flight included
                    target = min(target, cfg.release_cap - len(released) - m.groups_filtered)
                self._admit(version, target=target)
            if len(self.live) > before:
                queue.extend(self._queue_new(before))
            for kk in range(len(self.engines)):
                dispatch(kk)
            now = times[k]
            for kk in range(len(self.engines)):  # an idle engine waits until now
                if not self.engines[kk].num_active():
                    times[kk] = max(times[kk], now)

        self._end_phase(running, engine_of, m)
        end = max(times) if times else self.clock
        m.duration = end - self.clock
        m.slot_time_total = sum(e.slots for e in self.engines) * m.duration
        self.clock = end
        m.buffer_groups = len(self.live)
        m.prompts_discarded_twice = sum(1 for g in self.live.values() if g.discards >= 2) + sum(
            1 for _, d in self.requeued if d >= 2)
        return self.batch_order(released), m

    def _queue_new(self, first_new: int) -> list[tuple[int, int]]:
        """Queue entries for groups admitted during the phase (dict order = admission order)."""
        new = list(self.live)[first_new:]
        return [(index, j) for index in new for j in range(self.cfg.group_size)]

    def _forget_time(self, index: int) -> None:
        for j in range(self.cfg.group_size):
            self.slot_time.pop((index, j), None)

    def _release(self, index: int, version: int, released: list[Group], m: PhaseMetrics) -> None:
        g = self.live.pop(index)
        self.released.add(index)
        group = Group(index, g.item.prompt_text, g.item.answer, g.samples)
        self.score(group)
        lengths = [len(s.response_ids) for s in g.samples]
        if g.item.key is not None:
            self.length_cache[g.item.key] = sum(lengths) / len(lengths)
        times = [self.slot_time[(index, j)] for j in range(len(g.samples))]
        self._forget_time(index)
        if not self.keep_group(group):
            m.groups_filtered += 1
            m.tokens_wasted += sum(lengths)
            return
        for s, spent in zip(g.samples, times):
            s.status = SampleStatus.CONSUMED
            m.staleness.update(version - v for v in s.versions)
            m.interruptions += s.interruptions
            m.slot_time_useful += spent
        m.samples_trained += len(g.samples)
        m.groups_trained += 1
        m.tokens_useful += sum(lengths)
        m.len_trained_sum += sum(lengths)
        released.append(group)

    def _end_phase(self, running: dict, engine_of: dict, m: PhaseMetrics) -> None:
        """Abort what is still running: keep it (partial) or discard it and re-queue its prompt (on-policy)."""
        by_engine: dict[int, list[str]] = collections.defaultdict(list)
        for rid in running:
            by_engine[engine_of[rid]].append(rid)
        for k, rids in sorted(by_engine.items()):
            self.engines[k].abort(rids)
        for index, j in running.values():
            self.live[index].samples[j].status = SampleStatus.RESUMED
        if self.cfg.mode != "on_policy":
            return
        discarded = []
        for index in list(self.live):
            g = self.live[index]
            generated = sum(len(s.response_ids) for s in g.samples)
            if generated == 0:
                continue  # never started: stays admitted, nothing was spent on it
            m.tokens_wasted += generated
            del self.live[index]
            self._forget_time(index)
            discarded.append((g.item, g.discards + 1))
        self.requeued.extendleft(reversed(discarded))  # first in the next phase, in their order

    # ---- checkpointing -----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "live": {i: (g.item, g.samples, g.discards, g.admitted_version) for i, g in self.live.items()},
            "requeued": list(self.requeued),
            "length_cache": dict(self.length_cache),
            "released": set(self.released),
            "slot_time": dict(self.slot_time),
            "source_done": self.source_done,
            "clock": self.clock,
        }

    def load_state_dict(self, state: dict) -> None:
        self.live = {i: _Live(*v) for i, v in state["live"].items()}
        self.requeued = collections.deque(state["requeued"])
        self.length_cache = dict(state["length_cache"])
        self.released = set(state["released"])
        self.slot_time = collections.Counter(state["slot_time"])
        self.source_done = state["source_done"]
        self.clock = state["clock"]
