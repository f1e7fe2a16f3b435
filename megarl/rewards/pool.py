"""The sandboxed reward pool: worker processes, a per-call timeout, hung workers killed and replaced.

::

    score(items) ──► queue ──► idle ready worker ──(pipe)──► fn(response, answer, **extras)
                       ▲                  │ result / exception text ◄──┘
                       │                  ▼
                       │     past timeout_s: kill the worker, score ``on_error``,
                       └──── start a replacement (it joins once it reports ready)

Each worker is a fresh interpreter (``python -m megarl.rewards.pool``, so the caller's main
module is never re-imported, unlike multiprocessing's spawn) that resolves ``reward.fn`` itself (a built-in name
or ``package.module:function``), says ready, then serves one call at a time. A call
that raises, returns something that is not a number (or a dict with a numeric
``score``), or kills its worker scores ``on_error`` and counts as an error; one that
runs past ``timeout_s`` counts as a timeout. Nothing raises into the caller.
Invariants: every item gets exactly one score; a replaced worker takes calls only
once it is ready, so a hang costs the batch at most ``timeout_s`` of one worker.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from megarl.rewards.base import optional_args, resolve_reward

log = logging.getLogger("megarl.rewards.pool")  # by name: run as `python -m`, __name__ is "__main__"

RESERVED = {"mean", "pass_rate", "errors", "timeouts", "errors_step", "timeouts_step", "scored_mean"}


def _fresh_step() -> dict:
    """The training calls' per-step counts (``step_metrics`` reports and resets them)."""
    return {"errors": 0, "timeouts": 0, "seconds": 0.0, "sum": 0.0, "n": 0}


def _exit_with_parent(parent: int) -> None:
    """A worker whose parent died (killed mid-run) exits too, even while a reward call hangs."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def worker_start(conn, parent: int, resolve: Callable, *args, describe: Callable = repr):
    """A sandboxed worker's first acts: Slurm's preemption signals reach every process of the job step, and the
    trainer acts on them and ends us itself (blocked before any thread starts: a thread inherits the block, none is
    left for the signal to kill us through); we exit with our parent. Then ``resolve(*args)``, which the parent is
    told of: ready, or failed (``describe(exc)``, which it raises; None is returned then)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGUSR1))
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    try:
        out = resolve(*args)
    except Exception as exc:  # reported to the parent, which raises it at construction
        conn.send(("failed", describe(exc)))
        return None
    conn.send(("ready", None))
    return out


def calls(conn):
    """A worker's calls, in order, until its parent says stop (None) or goes away."""
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        yield msg


def _serve(conn, spec: str, format_coef: float, parent: int) -> None:
    """Worker main loop: resolve the function, report ready, then answer calls until told to stop."""
    fn = worker_start(conn, parent, resolve_reward, spec, format_coef)
    if fn is None:
        return
    named = optional_args(fn)
    for idx, response, answer, extras, optional in calls(conn):
        if "transcript" in named and optional["transcript"] is None:  # single-turn: the one assistant message
            optional["transcript"] = [{"role": "assistant", "content": response}]
        try:
            out = fn(response, answer, **extras, **{k: v for k, v in optional.items() if k in named})
            if isinstance(out, dict):
                extra = {k: float(v) for k, v in out.items() if k != "score"}
                out = out["score"]
            else:
                extra = {}
            score = float(out)
            if math.isnan(score):
                raise ValueError("the reward is NaN")
            conn.send((idx, True, score, extra))
        except Exception as exc:  # a user reward must not crash the worker or the run
            conn.send((idx, False, f"{type(exc).__name__}: {exc}"[:300], traceback.format_exc()[-6000:]))


class Worker:
    """One worker process (``python -m module FD *args PARENT_PID``) and its end of a socket pair (a
    ``multiprocessing`` Connection)."""

    def __init__(self, module: str, *args: str) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # user modules resolve alike
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, str(theirs.fileno()), *args, str(os.getpid())],
            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.ready = False
        self.task: tuple[int, float] | None = None  # (item index, deadline)

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.conn.close()


def wait_ready(workers: list[Worker], limit_s: float, key: str, spec: str) -> None:
    """Block until every worker resolved ``spec`` (the value of config key ``key``); one that failed to (or none
    within ``limit_s``) closes them all and raises, naming the key."""
    deadline = time.time() + limit_s
    while not all(w.ready for w in workers):
        left = deadline - time.time()
        if left <= 0:
            close_workers(workers)
            raise TimeoutError(f"workers for {key}={spec!r} not ready after {limit_s:.0f}s")
        for conn in wait([w.conn for w in workers if not w.ready], timeout=left):
            w = next(w for w in workers if w.conn is conn)
            try:
                kind, detail = conn.recv()
            except EOFError:
                kind, detail = "failed", f"worker exited with code {w.exitcode}"
            if kind != "ready":
                close_workers(workers)
                raise ValueError(detail if detail.startswith(f"{key}=") else f"{key}={spec!r}: {detail}")
            w.ready = True


def close_workers(workers: list[Worker]) -> None:
    """Each worker told to stop, then killed if it has not within 2 s."""
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
    for w in workers:
        try:
            w.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            w.kill()


class RewardPool:
    """Scores ``(response, answer[, extras])`` items in ``workers`` processes; see the module docstring."""

    def __init__(self, spec: str, workers: int = 2, timeout_s: float = 10.0, on_error: float = 0.0,
                 format_coef: float = 0.0, start_timeout_s: float = 120.0) -> None:
        self.spec, self.format_coef, self.timeout_s, self.on_error = spec, format_coef, timeout_s, on_error
        self._workers = [self._start() for _ in range(max(1, workers))]
        self.errors = self.timeouts = self.calls = 0
        self._step = _fresh_step()
        self._extras: dict[str, list[float]] = {}
        self._window = [0, 0]  # training calls and failed ones since the last failing_steps()
        self.failed_in_a_row, self.traceback_logged = 0, False
        self._wait_ready(start_timeout_s)

    def _start(self) -> Worker:
        return Worker("megarl.rewards.pool", self.spec, repr(self.format_coef))

    def _wait_ready(self, limit_s: float) -> None:
        """Block until every worker resolved the function; a bad ``reward.fn`` raises here, before training."""
        wait_ready(self._workers, limit_s, "reward.fn", self.spec)

    def score(self, items) -> list[float]:
        """One score per item, in order; failures score ``on_error`` and are counted, never raised. (The training
        loop's call: its calls, failures and extra values also feed ``failing_steps`` and ``step_metrics``' per-step
        figures; an evaluation's, through ``score_detailed``, only the cumulative counts.)"""
        start = time.time()
        scores, extras, errors, timeouts = self._score(items)
        self._step["seconds"] += time.time() - start
        self._step["sum"] += sum(scores)
        self._step["n"] += len(scores)
        self._window[0] += len(scores)
        self._window[1] += errors + timeouts
        self._step["errors"] += errors
        self._step["timeouts"] += timeouts
        for extra in extras:
            for k, v in extra.items():
                self._extras.setdefault(k, []).append(v)
        return scores

    def score_detailed(self, items) -> tuple[list[float], list[dict]]:
        """Scores and, per item, the extra values its function returned (``{}`` for a plain float)."""
        return self._score(items)[:2]

    def _score(self, items) -> tuple[list[float], list[dict], int, int]:
        """Scores, extras, and how many calls failed and timed out (also added to the cumulative counts)."""
        queue = deque(enumerate(items))
        scores: list[float | None] = [None] * len(queue)
        extras: list[dict] = [{} for _ in scores]
        errors, timeouts, last_error = 0, 0, ""
        while queue or any(w.task for w in self._workers):
            for w in self._workers:
                if w.ready and w.task is None and queue:
                    idx, item = queue.popleft()
                    # (response, answer[, row extras[, finish_reason[, transcript]]])
                    response, answer, row, finish, transcript = (list(item) + [{}, "", None][len(item) - 2:])[:5]
                    w.conn.send((idx, response, answer, row or {},
                                 {"finish_reason": finish, "transcript": transcript}))
                    w.task = (idx, time.time() + self.timeout_s)
            busy = [w for w in self._workers if w.task or not w.ready]
            deadlines = [w.task[1] for w in busy if w.task]
            timeout = max(0.0, min(deadlines) - time.time()) if deadlines else self.timeout_s
            for conn in wait([w.conn for w in busy], timeout=timeout):
                i = next(i for i, w in enumerate(self._workers) if w.conn is conn)
                w = self._workers[i]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):  # the worker died (os._exit, a crash in C code, OOM)
                    if w.task:
                        scores[w.task[0]], errors = self.on_error, errors + 1
                        last_error = f"worker died (exit code {w.exitcode})"
                    self._replace(i)
                    continue
                if msg[0] in ("ready", "failed"):
                    w.ready = msg[0] == "ready"
                    if not w.ready:
                        self._replace(i)
                    continue
                idx, ok, value, extra = msg
                w.task = None
                if ok:
                    scores[idx], extras[idx] = value, extra
                else:
                    scores[idx], errors, last_error = self.on_error, errors + 1, value
                    self._log_traceback(extra)
            now = time.time()
            for i, w in enumerate(self._workers):
                if w.task and w.task[1] <= now:
                    scores[w.task[0]], timeouts = self.on_error, timeouts + 1
                    self._replace(i)
        if errors:
            log.warning("reward: %d of %d calls failed (last: %s); scored %s", errors, len(scores), last_error,
                        self.on_error)
        if timeouts:
            log.warning("reward: %d of %d calls ran past %.1fs; workers replaced, scored %s", timeouts, len(scores),
                        self.timeout_s, self.on_error)
        self.calls += len(scores)
        self.errors += errors
        self.timeouts += timeouts
        return [float(s) for s in scores], extras, errors, timeouts

    def _log_traceback(self, text: str | None) -> None:
        """The first failed call's full traceback (file and line in the reward's own code), once per pool."""
        if text and not self.traceback_logged:
            self.traceback_logged = True
            log.error("reward: a call of reward.fn=%r failed; its traceback (shown once; later failures are counted "
                      "in reward/errors):\n%s", self.spec, text.rstrip())

    def failing_steps(self) -> int:
        """Steps in a row in which every training reward call failed or timed out (a step: the calls between two
        calls of this, which the loop makes before each step's phase; it stops at ``reward.max_failed_steps``)."""
        calls, failed = self._window
        if calls:
            self.failed_in_a_row = self.failed_in_a_row + 1 if failed == calls else 0
        self._window = [0, 0]
        return self.failed_in_a_row

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = self._start()

    def step_metrics(self) -> dict[str, float]:
        """``reward/errors``/``timeouts`` (cumulative, evaluations included), ``*_step`` (the training calls since
        the last call of this), ``reward/<name>`` means and ``reward/scored_mean`` (of those training calls: every
        sample scored, groups dynamic sampling drops included) and ``timing/reward_s`` (their wall time, a part of
        ``timing/gen_s``: groups are scored as they are released)."""
        out = {"reward/errors": float(self.errors), "reward/timeouts": float(self.timeouts),
               "reward/errors_step": float(self._step["errors"]),
               "reward/timeouts_step": float(self._step["timeouts"]), "timing/reward_s": self._step["seconds"]}
        if self._step["n"]:
            out["reward/scored_mean"] = self._step["sum"] / self._step["n"]
        for k, vals in self._extras.items():
            out[f"reward/{'fn_' + k if k in RESERVED else k}"] = sum(vals) / len(vals)
        self._step = _fresh_step()
        self._extras = {}
        return out

    def state_dict(self) -> dict:
        return {"calls": self.calls, "errors": self.errors, "timeouts": self.timeouts}

    def load_state_dict(self, state: dict) -> None:
        self.calls, self.errors, self.timeouts = state["calls"], state["errors"], state["timeouts"]

    def close(self) -> None:
        close_workers(self._workers)
        self._workers = []

    def __del__(self) -> None:
        try:
            if self._workers:
                self.close()
        except Exception:
            pass


def reward_spec(r, d) -> str:
    """``reward.fn``, or the built-in task's own reward when it is empty (a dataset needs one named)."""
    if r.fn:
        return r.fn
    if d.path:
        raise ValueError("reward.fn must be set for a dataset (data.path): 'math', 'exact', or "
                         "'package.module:function'")
    return d.task


def build_rewards(r, d) -> RewardPool:
    """The reward pool ``reward.*`` asks for (workers start now; a bad ``reward.fn`` raises here)."""
    if r.workers < 1 or r.timeout_s <= 0:
        raise ValueError(f"reward.workers must be >= 1 and reward.timeout_s > 0, got {r.workers}, {r.timeout_s}")
    return RewardPool(reward_spec(r, d), r.workers, r.timeout_s, r.on_error, r.format_coef)


if __name__ == "__main__":  # a worker: python -m megarl.rewards.pool FD SPEC FORMAT_COEF PARENT_PID
    _serve(Connection(int(sys.argv[1])), sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
