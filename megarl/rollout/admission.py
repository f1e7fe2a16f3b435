"""What is live and what runs next: admission, the re-queue and long-prompt queues, the dispatch order.

``PromptBuffer`` is the state half of the SortedRL controller (``controller.py``
holds the phase loop): the groups in flight (``live``, including partial samples
and groups held whole past the update-batch bound), the prompts parked after an
on-policy discard (``requeued``, admitted first; ``long_queue``, for long rounds),
what is known of each prompt's length (``length_cache``, ``progress``), and the
checkpoint of all of it (``state_dict``). Pure Python.
"""

from __future__ import annotations

import collections
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass

from megarl.rollout.expected import remaining
from megarl.rollout.phase_metrics import PhaseMetrics
from megarl.types import Sample, SampleStatus

LONG_WAIT = 8  # long rounds: phases a prompt may wait in the long queue before a round is forced


@dataclass
class PromptItem:
    """A prompt from the source: a stable index, its tokens, and what the reward needs."""

    index: int
    prompt_ids: list[int]
    prompt_text: str = ""
    answer: str = ""
    key: object = None  # identity for the length cache (same prompt in a later epoch)
    extras: dict | None = None  # the row's other columns: the reward's keyword arguments for this prompt's group


@dataclass
class LiveGroup:
    """A group in flight: its samples, its prompt, how often it was discarded, when it was first admitted."""

    item: PromptItem
    samples: list[Sample]
    discards: int = 0
    admitted_version: int = 0


class PromptBuffer:
    """Groups in flight and parked prompts; admission and queue order. ``cfg`` is a ``ControllerConfig``."""

    def __init__(self, cfg, next_prompt: Callable[[], PromptItem | None]) -> None:
        self.cfg, self.next_prompt = cfg, next_prompt
        self.live: dict[int, LiveGroup] = {}  # prompt index → group in flight (or buffered, or held complete)
        # parked prompts: (item, discards, version first admitted); re-queued first, long queue for long rounds
        self.requeued: collections.deque[tuple[PromptItem, int, int]] = collections.deque()
        self.long_queue: collections.deque[tuple[PromptItem, int, int]] = collections.deque()
        self.progress: dict[int, int] = {}  # prompt index → most tokens a sample reached before a discard
        self.length_cache: dict[object, float] = {}  # prompt key → mean generated length (the model's tokens)
        # multi-turn (``expected.py``): prompt key → mean model turns, mean environment seconds of a trajectory;
        # slot-seconds per sampled token (the last phase that generated)
        self.turns_cache: dict[object, float] = {}
        self.env_cache: dict[object, float] = {}
        self.token_s = 0.0
        self.released: set[int] = set()
        self.slot_time: collections.Counter = collections.Counter()  # (index, j) → engine slot-time spent
        self.source_done = False
        self.clock = 0.0  # engine time across phases
        self.in_phase: dict[int, LiveGroup] = {}  # groups the phase in flight released so far (its batch-to-be)
        # the phase's batch stays in ``in_phase`` after it, until ``hand_over`` (the pipeline's thread's phases)
        self.keep_batch = False
        # the state lock: held by every change of the state outside the engines' gate (a released group scored, a
        # stale group dropped, episodes swept, a failed phase put back, a batch handed over) and by a checkpoint
        # (``state_dict``, ``session_state.rollout_state``), so that it sees every prompt in exactly one place
        self.lock = threading.RLock()

    def _new_group(self, item: PromptItem, version: int, discards: int = 0, first: int | None = None) -> int:
        if item.index in self.live or item.index in self.released:
            raise RuntimeError(f"prompt {item.index} admitted twice")
        samples = [Sample(prompt_ids=list(item.prompt_ids)) for _ in range(self.cfg.group_size)]
        self.live[item.index] = LiveGroup(item, samples, discards, version if first is None else first)
        return item.index

    def admit_one(self, version: int) -> int | None:
        """Admit the next prompt (re-queued first); its index, or None when the source is dry."""
        if self.requeued:
            item, discards, first = self.requeued.popleft()
            return self._new_group(item, version, discards, first)
        item = None if self.source_done else self.next_prompt()
        if item is None:
            self.source_done = True
            return None
        return self._new_group(item, version)

    def admit(self, version: int, target: int) -> None:
        while len(self.live) < target and self.admit_one(version) is not None:
            pass

    def _hint(self, index: int) -> float:
        """Expected rest of a group, in tokens: its slowest unfinished sample's model tokens still to come (the
        prompt's cached mean, or at least what a discarded sample reached, less what it has) and, multi-turn, its
        environment's time still to come (``expected.remaining``)."""
        g = self.live[index]
        key = g.item.key
        tokens = max(self.length_cache.get(key, 0.0), self.progress.get(index, 0))
        turns, env_s = self.turns_cache.get(key, 1.0), self.env_cache.get(key, 0.0)
        return max((remaining(s, tokens, turns, env_s, self.token_s) for s in g.samples
                    if s.status not in (SampleStatus.FINISHED, SampleStatus.TRUNCATED, SampleStatus.CONSUMED)),
                   default=0.0)

    def learn(self, item: PromptItem, samples: list[Sample]) -> None:
        """A released group's trajectories: its prompt's mean model tokens, and (multi-turn) turns and environment
        seconds, for the next time it is admitted."""
        if item.key is None:
            return
        n = len(samples)
        self.length_cache[item.key] = sum(s.model_tokens for s in samples) / n
        if any(s.env_messages or s.env_s for s in samples):
            self.turns_cache[item.key] = sum(s.turns for s in samples) / n
            self.env_cache[item.key] = sum(s.env_s for s in samples) / n

    def expire_stale(self, version: int, m: PhaseMetrics) -> None:
        """Partial mode: samples whose oldest token is more than k versions old are not resumed (under the lock: a
        phase's start, outside the engines' gate)."""
        with self.lock:
            for index in list(self.live):
                if self.stale_samples(index, version) and self.cfg.stale_action == "drop":
                    g = self.live.pop(index)
                    m.tokens_wasted += sum(s.model_tokens for s in g.samples)
                    self.forget_time(index)
                    self.requeued.appendleft((g.item, g.discards, g.admitted_version))
                else:
                    self.regenerate_stale(index, version, m)

    def stale_samples(self, index: int, version: int) -> list[int]:
        """The samples of live group ``index`` with a token sampled more than k versions before ``version``."""
        k = self.cfg.staleness_limit
        return [j for j, s in enumerate(self.live[index].samples) if s.versions and version - min(s.versions) > k]

    def regenerate_stale(self, index: int, version: int, m: PhaseMetrics) -> list[int]:
        """The stale samples of group ``index`` (``stale_samples``) start again from their prompt (their tokens
        counted as waste); which they were."""
        stale = self.stale_samples(index, version)
        for j in stale:
            s = self.live[index].samples[j]
            m.tokens_wasted += s.model_tokens
            self.slot_time.pop((index, j), None)
            s.restart()  # (its episode starts afresh too)
        return stale

    def entries(self, indices) -> list[tuple[int, int]]:
        return [(i, j) for i in indices for j, s in enumerate(self.live[i].samples)
                if s.status in (SampleStatus.QUEUED, SampleStatus.RESUMED)]

    def run_order(self, members: set[int] | None, pinned: set[int]) -> collections.deque[tuple[int, int]]:
        """Samples to run: resumed first, then pinned and re-queued groups (longest first), then new (LPT or FIFO)."""
        indices = [i for i in self.live if members is None or i in members]
        if members is not None:  # a long round: everything longest first
            return collections.deque(self.entries(sorted(indices, key=lambda i: -self._hint(i))))
        resumed = [(i, j) for i, j in self.entries(indices) if self.live[i].samples[j].response_ids]
        back = [i for i in indices if self.live[i].discards]
        back.sort(key=lambda i: (i not in pinned, -self._hint(i)))
        fresh = [i for i in indices if not self.live[i].discards]
        if self.cfg.dispatch == "lpt" and all(self.live[i].item.key in self.length_cache for i in fresh):
            fresh.sort(key=lambda i: -self._hint(i))  # (multi-turn: model tokens and tool time to come)
        queued = [(i, j) for i, j in self.entries(back + fresh) if not self.live[i].samples[j].response_ids]
        return collections.deque(resumed + queued)

    def balance(self, queue: collections.deque, only: set[int], engines: list) -> list[collections.deque]:
        """LPT placement of a long round's (or the pinned groups') samples, in queue order (longest first): each on
        the engine with a free slot whose placed samples are shortest in sum (by ``_hint``: the length a discarded
        sample had reached, or the cached mean), so no engine holds more of the long work than it must (the phase
        lasts as long as its slowest engine). Returns one queue per engine; the rest stays in the shared queue."""
        own = [collections.deque() for _ in engines]
        load = [0.0] * len(engines)
        room = [e.slots - e.num_active() for e in engines]
        if not only:
            return own
        rest = collections.deque()
        for index, j in queue:
            free = [k for k in range(len(own)) if room[k] > 0] if index in only else None
            if not free:
                rest.append((index, j))
                continue
            k = min(free, key=lambda k: (load[k], k))
            own[k].append((index, j))
            room[k] -= 1
            load[k] += max(self._hint(index), 1.0)
        queue.clear()
        queue.extend(rest)
        return own

    def pin(self) -> set[int]:
        """On-policy drain guard: groups discarded `max_discards` times get a reserved place (at most U)."""
        if self.cfg.mode != "on_policy" or self.cfg.long_rounds:
            return set()
        due = [i for i, g in self.live.items() if g.discards >= self.cfg.max_discards]
        return set(due[:self.cfg.update_groups])

    def long_round(self, version: int) -> set[int] | None:
        """Tail batching: once the long queue holds ``long_round_groups`` (default U) prompts, or its oldest waited
        LONG_WAIT phases, or the source is dry, admit up to that many of them, topped up to U (never-started groups,
        then new prompts), as this phase's only members."""
        cfg, q = self.cfg, self.long_queue
        size = min(cfg.long_round_groups or cfg.update_groups, cfg.update_groups)
        due = q and (len(q) >= size or version - q[0][2] >= LONG_WAIT or self.source_done)
        if not (cfg.long_rounds and cfg.mode == "on_policy" and due):
            return None
        members = set()
        while q and len(members) < size:
            item, discards, first = q.popleft()
            members.add(self._new_group(item, version, discards, first))
        for index, g in self.live.items():  # top up with admitted groups that never started, then new ones
            if len(members) < cfg.update_groups and index not in members and not any(s.response_ids for s in g.samples):
                members.add(index)
        while len(members) < cfg.update_groups and (index := self.admit_one(version)) is not None:
            members.add(index)
        return members

    def requeue_groups(self, groups: list, version: int) -> None:
        """Released groups that will not be trained (``Group``s of batches a resumed run cannot take): their prompts
        back at the head of the queue, generated again."""
        for g in reversed(groups):
            self.released.discard(g.prompt_index)
            item = PromptItem(g.prompt_index, list(g.samples[0].prompt_ids), g.prompt_text, g.answer, extras=g.extras)
            self.requeued.appendleft((item, 0, version))

    def hand_over(self) -> None:
        """The batch the last phase kept (``keep_batch``) leaves the controller's state (``in_phase``): its caller
        holds it now (the pipeline's queue, which takes it in the same hold of the lock)."""
        with self.lock:
            self.in_phase.clear()

    def forget_time(self, index: int) -> None:
        for j in range(self.cfg.group_size):
            self.slot_time.pop((index, j), None)


    # ---- checkpointing -----------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything live and parked; taken while a phase runs (between two engine steps: ``Pipeline.pause``), the
        groups it released so far count as live again and its running samples as resumed (``load_state_dict``), so
        that a run resumed from it generates the batch again from there."""
        with self.lock:
            return self._state()

    def snapshot(self) -> bytes:
        """``state_dict`` pickled at once, under the lock: a copy that later changes (a group still being scored
        when a checkpoint is taken) cannot reach."""
        with self.lock:
            return pickle.dumps(self._state())

    def _state(self) -> dict:
        live = {**self.live, **self.in_phase}
        return {
            "live": {i: (g.item, g.samples, g.discards, g.admitted_version) for i, g in live.items()},
            "requeued": list(self.requeued),
            "long_queue": list(self.long_queue),
            "progress": dict(self.progress),
            "length_cache": dict(self.length_cache),
            "turns_cache": dict(self.turns_cache),
            "env_cache": dict(self.env_cache),
            "token_s": self.token_s,
            "released": set(self.released) - set(self.in_phase),
            "slot_time": dict(self.slot_time),
            "source_done": self.source_done,
            "clock": self.clock,
        }

    def load_state_dict(self, state: dict) -> None:
        self.live = {i: LiveGroup(*v) for i, v in state["live"].items()}
        self.in_phase = {}
        for g in self.live.values():  # a state taken mid-phase: running samples resume, released ones are done
            for x in g.samples:
                if x.status is SampleStatus.RUNNING:
                    x.status = SampleStatus.RESUMED
                elif x.status is SampleStatus.CONSUMED:
                    x.status = SampleStatus.FINISHED if x.finish_reason == "stop" else SampleStatus.TRUNCATED
        # a requeued entry saved as a 2-tuple (an older state) gets a 0 appended
        self.requeued = collections.deque((*e, 0) if len(e) == 2 else tuple(e) for e in state["requeued"])
        self.long_queue = collections.deque(tuple(e) for e in state.get("long_queue", ()))
        self.progress = dict(state.get("progress", {}))
        self.length_cache = dict(state["length_cache"])
        self.turns_cache, self.env_cache = dict(state.get("turns_cache", {})), dict(state.get("env_cache", {}))
        self.token_s = state.get("token_s", 0.0)
        self.released = set(state["released"])
        self.slot_time = collections.Counter(state["slot_time"])
        self.source_done = state["source_done"]
        self.clock = state["clock"]

