"""A discrete-event engine for the rollout simulator: S slots, known sample lengths, modelled step time.

Each decode step every active sequence emits one token; a sequence stops with
'stop' when it reaches its full length from the trace, or with 'length' when its
request's ``max_tokens`` runs out. A decode step costs ``base`` seconds
(``constant`` model) or ``base + per_seq · active`` (``batch`` model: decode cost
grows with the number of sequences in the batch).

For speed one ``step()`` advances several decode steps at once: up to the next
finish (nothing changes for the controller in between) and at most
``max_chunk`` steps, so that engines running side by side stay within
``max_chunk`` decode steps of each other in simulated time.

Engines that share a ``Weights`` tag their tokens with the weight version they
hold at their own time (the simulator's model of weights loaded while a phase
runs, ``rollout.overlap``), read at the start of each step. Each engine keeps its
own time: the phase's start, plus its steps, an idle engine given work starting
at the latest step's end. The controller's phase keeps such an engine at an
earlier time, so the two can differ by about one engine step; a version is
never older than the one at the phase's start (times only grow from it), so the
staleness bound holds all the same.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from megarl.types import SlotRequest, StepReport, TokenEvent


def sim_token(position: int) -> int:
    """The token a simulated sample emits at ``position`` (a function of position only)."""
    return 2 + position % 7


def sim_logprob(key: tuple[int, int], position: int) -> float:
    """A distinct, reproducible behaviour logprob per (sample, position), so tests can trace it."""
    return -0.001 * (position + 1) - 0.01 * key[1] - 1e-6 * key[0]


class _Tables:
    """``sim_token`` and the position part of ``sim_logprob`` precomputed, so a step slices instead of looping."""

    def __init__(self) -> None:
        self.size = 0
        self.tokens: list[int] = []
        self.base = np.zeros(0)
        self.base_list: list[float] = []

    def grow(self, n: int) -> None:
        if n > self.size:
            self.size = max(n, 2 * self.size, 4096)
            self.tokens = [sim_token(t) for t in range(self.size)]
            self.base = -0.001 * (np.arange(self.size, dtype=np.float64) + 1)
            self.base_list = self.base.tolist()

    def logprobs(self, key: tuple[int, int], start: int, end: int) -> list[float]:
        a, b = 0.01 * key[1], 1e-6 * key[0]  # the same float operations as sim_logprob
        if end - start <= 16:
            return [(x - a) - b for x in self.base_list[start:end]]
        return ((self.base[start:end] - a) - b).tolist()


_TABLES = _Tables()


class StepTimeModel:
    def __init__(self, kind: str = "batch", base: float = 0.02, per_seq: float = 0.0002) -> None:
        if kind not in ("constant", "batch"):
            raise ValueError(f"step time model must be 'constant' or 'batch', got {kind!r}")
        self.kind, self.base, self.per_seq = kind, base, per_seq

    def __call__(self, active: int) -> float:
        return self.base if self.kind == "constant" else self.base + self.per_seq * active


class Weights:
    """The weight version engines sample with, as a function of engine time (``version_at``; None: the phase's),
    and the time of the latest engine step (``now``)."""

    def __init__(self) -> None:
        self.version_at: Callable[[float], int] | None = None
        self.now = 0.0

    def start_phase(self, clock: float, engines: list[SimulatedEngine],
                    version_at: Callable[[float], int] | None) -> None:
        """Every engine starts the phase at the controller's ``clock`` (as the phase counts time)."""
        self.now, self.version_at = clock, version_at
        for engine in engines:
            engine.clock = clock


class SimulatedEngine:
    """Implements ``SlotEngine`` with lengths looked up by (prompt index, sample index)."""

    def __init__(self, slots: int, length_of: Callable[[tuple[int, int]], int], step_time: StepTimeModel,
                 max_chunk: int = 32, weights: Weights | None = None) -> None:
        self.slots, self.length_of, self.step_time, self.max_chunk = slots, length_of, step_time, max_chunk
        self.weights, self.clock = weights, 0.0
        self._active: dict[str, list] = {}  # rid → [full length, generated so far, tokens left, key]

    def submit(self, request: SlotRequest) -> None:
        if len(self._active) >= self.slots:
            raise RuntimeError("simulated engine: submit beyond its slots")
        if not self._active and self.weights is not None:
            self.clock = max(self.clock, self.weights.now)
        self._active[request.request_id] = [self.length_of(request.key), request.generated, request.max_tokens,
                                            request.key]

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._active.pop(rid, None)

    def num_active(self) -> int:
        return len(self._active)

    def reset(self) -> None:
        self._active.clear()

    def reseed(self, seed: int) -> None:
        pass  # lengths are looked up, not sampled

    def step(self) -> StepReport:
        active = len(self._active)
        if not active:
            return StepReport([], 0.0, 0)
        n = max(1, min(self.max_chunk, *(min(full - done, left) for full, done, left, _ in self._active.values())))
        w = self.weights
        version = w.version_at(self.clock) if w is not None and w.version_at is not None else None
        events, tables = [], _TABLES
        finished = []
        for rid, state in self._active.items():
            start = state[1]
            state[1] += n
            state[2] -= n
            tables.grow(state[1])
            ev = TokenEvent(rid, tables.tokens[start:state[1]], tables.logprobs(state[3], start, state[1]),
                            version=version)
            if state[1] >= state[0]:
                ev.finished, ev.finish_reason = True, "stop"
            elif state[2] <= 0:
                ev.finished, ev.finish_reason = True, "length"
            if ev.finished:
                finished.append(rid)
            events.append(ev)
        for rid in finished:
            del self._active[rid]
        elapsed = n * self.step_time(active)
        self.clock += elapsed
        if w is not None:
            w.now = self.clock
        return StepReport(events, elapsed, active)
