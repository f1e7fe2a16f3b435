"""What ran when: spans on named tracks (the rollout controller, each engine replica, the reward pool, each
trainer rank), for the pipeline's per-step figures and ``train.trace``'s Chrome trace.

Tracks: ``rollout`` (one span per generation phase), ``replica K`` (its engine steps, contiguous ones merged into
one ``generate`` span), ``reward`` (each released group scored), ``environments`` (each answered environment call,
multi-turn), ``trainer rank R`` (``train``, ``sync``, ``checkpoint``, ``evaluate``). The per-step figures come from
the spans inside a step's window:

- ``timing/engine_idle_s``: the step's wall time in which an engine took no step, from each replica's own spans
  (the mean over replicas: a phase waiting at the engines' gate, for a sync or a checkpoint, is idle time);
- ``pipeline/overlap_fraction``: the share of it in which an engine stepped *and* the trainer trained.

``write_trace`` merges every rank's spans into ``trace.json`` at the run's end (the Trace Event Format: one complete
event per span, one process per rank, one thread per track), which Perfetto (ui.perfetto.dev) and chrome://tracing
open. Meanwhile each rank appends its finished spans to ``trace/rank_N.<start time>.json`` every step (``flush``: a
JSON array the format lets stay unterminated), so a run killed with SIGKILL keeps its trace up to its last step.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from pathlib import Path

MERGE_GAP_S = 0.002
"""Spans of one track and name closer than this are one span (an engine's back-to-back steps)."""


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


class Timeline:
    """Spans of this process (thread-safe); ``keep_all`` (``train.trace``) keeps every span for the trace, else
    only those a step's figures still need."""

    def __init__(self, rank: int = 0, keep_all: bool = False, append_to: str | Path | None = None) -> None:
        """``append_to``: the directory this rank's trace is appended to, step by step (``train.trace``)."""
        self.rank, self.keep_all = rank, keep_all
        self.spans: list[list] = []  # [track, name, start, end] in perf_counter seconds
        self._last: dict[tuple[str, str], list] = {}
        self._lock = threading.Lock()
        self.origin = time.perf_counter()
        self.origin_wall = time.time()
        # one file per rank and process start: a resumed run keeps the trace of the segment before it
        self.file = Path(append_to) / f"rank_{rank}.{int(self.origin_wall)}.json" if append_to is not None else None
        self._written: set[int] = set()  # id() of the spans the file holds
        self._tracks: list[str] = []  # the file's tracks, by thread id

    def add(self, track: str, name: str, start: float, end: float, merge: bool = False) -> None:
        with self._lock:
            last = self._last.get((track, name))
            if merge and last is not None and start - last[3] < MERGE_GAP_S:
                last[3] = max(last[3], end)
                return
            span = [track, name, start, end]
            self.spans.append(span)
            self._last[(track, name)] = span

    @contextlib.contextmanager
    def span(self, track: str, name: str):
        """A span open while the block runs: a step's figures see it up to their window's end (a phase of the
        generating thread that outlasts the step it overlapped)."""
        span = [track, name, time.perf_counter(), math.inf]
        with self._lock:
            self.spans.append(span)
        try:
            yield
        finally:
            with self._lock:
                span[3] = time.perf_counter()

    def flush(self) -> None:
        """Append the spans that ended since the last flush to this rank's trace file (``append_to``)."""
        if self.file is None:
            return
        with self._lock:
            done = [s for s in self.spans if s[3] != math.inf and id(s) not in self._written]
            self._written.update(id(s) for s in done)
        if not done:
            return
        lines = [] if self.file.exists() else ["["]
        base = (self.origin_wall - self.origin) * 1e6
        for track, name, start, end in done:
            if track not in self._tracks:
                self._tracks.append(track)
                lines.append(json.dumps({"ph": "M", "name": "thread_name", "pid": self.rank,
                                         "tid": self._tracks.index(track), "args": {"name": track}}) + ",")
            lines.append(json.dumps({"ph": "X", "name": name, "cat": track.split(" ")[0], "pid": self.rank,
                                     "tid": self._tracks.index(track), "ts": round(base + start * 1e6, 1),
                                     "dur": round(max(end - start, 0.0) * 1e6, 1)}) + ",")
        self.file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.file, "a") as f:
            f.write("\n".join(lines) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def step_metrics(self, start: float, end: float, trainer_track: str) -> dict[str, float]:
        """This step's engine idle time and overlap (see the module docstring), from the spans in [start, end]."""
        self.flush()
        wall = max(end - start, 1e-9)
        with self._lock:
            clipped = [(t, max(a, start), min(b, end)) for t, _, a, b in self.spans if b > start and a < end]
            if not self.keep_all:  # what a later step may still need: spans open or still running at this step's end
                self.spans = [s for s in self.spans if s[3] >= end]
                self._last = {k: v for k, v in self._last.items() if v[3] >= end}
        replicas = sorted({t for t, _, _ in clipped if t.startswith("replica ")})
        busy = [_union([(a, b) for t, a, b in clipped if t == r]) for r in replicas]
        train = _union([(a, b) for t, a, b in clipped if t == trainer_track])
        idle = sum(wall - _length(b) for b in busy) / len(busy) if busy else wall
        stepping = _union([x for b in busy for x in b])
        return {"timing/engine_idle_s": max(0.0, idle),
                "pipeline/overlap_fraction": _length(_intersect(stepping, train)) / wall}

    def events(self) -> list[dict]:
        """This process's spans as Trace Event Format complete events (µs since the run's start, wall clock)."""
        base = (self.origin_wall - self.origin) * 1e6
        now = time.perf_counter()
        with self._lock:
            spans = [[t, n, a, min(b, now)] for t, n, a, b in self.spans]
        tracks = sorted({s[0] for s in spans})
        out = [{"ph": "M", "name": "process_name", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        out += [{"ph": "M", "name": "thread_name", "pid": self.rank, "tid": i, "args": {"name": t}}
                for i, t in enumerate(tracks)]
        out += [{"ph": "X", "name": name, "cat": track.split(" ")[0], "pid": self.rank, "tid": tracks.index(track),
                 "ts": round(base + start * 1e6, 1), "dur": round(max(end - start, 0.0) * 1e6, 1)}
                for track, name, start, end in spans]
        return out


def write_trace(path: str | Path, per_rank_events: list[list[dict]]) -> Path:
    """Every rank's events as one trace file, written atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"traceEvents": [e for events in per_rank_events for e in events],
                               "displayTimeUnit": "ms"}))
    os.replace(tmp, path)
    return path
