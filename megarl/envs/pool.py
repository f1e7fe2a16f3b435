"""The sandboxed environment pool: the rewards' worker processes (``rewards/pool.py``), holding instances per sample.

::

    submit(key, row, response[, state]) ──► the key's home worker (least loaded, fixed for the episode)
                                      │  Env(**row) on the first call (or the pickled ``state`` it is given);
                                      │  reply = env.step(response); the instance pickled after it (``state``)
    poll() ◄── EnvResult(key, message | None, error, state) ◄──┘
               past timeout_s: the worker is killed and replaced; its call times out, and every other episode it
               held is lost (its instance died with it): its next call is answered so, counted in ``env/lost``
               (``rollout/turns.py`` then rebuilds the instance from the one kept after its last answer)

Unlike a reward call, ``submit`` returns at once: the rollout controller goes on generating while environments work,
and collects their answers with ``poll``. A call that raises, returns a wrong type, hangs past ``env.timeout_s`` or
kills its worker ends its episode (``EnvResult.error``) and is counted; nothing raises into the caller.
Invariants: every submitted call gets exactly one result; a key's calls run in order on one worker.

After each answer that does not end its episode the worker pickles the instance and sends it along
(``EnvResult.state``; ``state_error`` says why an instance cannot be pickled): a run checkpoint keeps it, and a resumed
run rebuilds the instance from it (``submit(..., state=...)``), so the episode goes on where it was (``turns.py``).
"""

from __future__ import annotations

import collections
import logging
import pickle
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from megarl.envs.base import as_message, resolve_env
from megarl.rewards.pool import Worker, calls, close_workers, wait_ready, worker_start

log = logging.getLogger("megarl.envs.pool")  # by name: run as `python -m`, __name__ is "__main__"


@dataclass
class EnvResult:
    """The answer to one ``step`` call: the next message (None: the episode ended) or why it failed."""

    key: object
    message: dict | None = None
    error: str = ""  # '' on success; else what went wrong (the episode ends)
    kind: str = ""  # 'error' | 'timeout' | 'lost' when ``error`` is set
    seconds: float = 0.0
    state: bytes | None = None  # the instance pickled after the call (an answer that does not end the episode)
    state_error: str = ""  # why it could not be pickled


def _serve(conn, spec: str, tools: str, parent: int) -> None:
    """Worker main loop: resolve the class, report ready, then run calls (``step``/``end``) until told to stop."""
    cls = worker_start(conn, parent, resolve_env, spec, tools, describe=str)  # (its error names env.fn)
    if cls is None:
        return
    envs: dict = {}
    for op, key, *rest in calls(conn):
        if op == "end":
            envs.pop(key, None)
            continue
        row, response, state = rest
        started = time.perf_counter()
        try:
            if state is not None:  # a resumed episode: its instance as a checkpoint kept it
                envs[key] = pickle.loads(state)
            elif key not in envs:
                envs[key] = cls(**row)
            message = as_message(envs[key].step(response))
        except Exception as exc:  # a user environment must not crash the worker or the run
            envs.pop(key, None)
            conn.send((key, False, f"{type(exc).__name__}: {exc}"[:300], traceback.format_exc()[-6000:], None,
                       time.perf_counter() - started))
            continue
        state = None if message is None else _pickled(envs[key])
        conn.send((key, True, message, "", state, time.perf_counter() - started))


def _pickled(env) -> bytes | str:
    """The instance as a checkpoint keeps it, or why it cannot be pickled (a str)."""
    try:
        return pickle.dumps(env)
    except Exception as exc:  # (an open file, a lambda, a lock: the episode restarts on a resume)
        return f"{type(exc).__name__}: {exc}"[:200]


class EnvPool:
    """Runs environment calls in ``workers`` processes, one instance per episode key; see the module docstring."""

    def __init__(self, spec: str, workers: int = 2, timeout_s: float = 10.0, start_timeout_s: float = 120.0,
                 tools: str = "", runs: bool = True) -> None:
        """``tools``: ``env.tools`` (the built-in ``env.fn: tools``). ``runs=False``: a trainer rank whose
        environments rank 0 runs (``turns.Episodes``' ``shared``): no workers; calls are counted and go nowhere."""
        self.spec, self.timeout_s, self.tools, self.runs = spec, timeout_s, tools, runs
        self._workers = [self._start() for _ in range(max(1, workers) if runs else 0)]
        self._queues: list[collections.deque] = [collections.deque() for _ in self._workers]
        self._home: dict[object, int] = {}  # episode key → the worker holding its instance
        self._lost: set = set()  # episodes whose instance died with a replaced worker
        self._done: list[EnvResult] = []
        self.calls = self.errors = self.timeouts = self.lost = 0
        self.resumed = self.restarted = 0  # episodes a resume (or a failed phase put back) continued / restarted
        self.seconds, self.traceback_logged = 0.0, False
        self._wait_ready(start_timeout_s)

    def _start(self) -> Worker:
        return Worker("megarl.envs.pool", self.spec, self.tools)

    def _wait_ready(self, limit_s: float) -> None:
        """Block until every worker resolved the class; a bad ``env.fn`` raises here, before any episode."""
        wait_ready(self._workers, limit_s, "env.fn", self.spec)

    # ---- calls ------------------------------------------------------------------------------
    def submit(self, key, row: dict, response: str, state: bytes | None = None) -> None:
        """Ask episode ``key``'s environment for its next message (built from ``row`` on the first call, or from
        ``state``, an ``EnvResult.state`` of an earlier run, when given)."""
        self.calls += 1
        if not self.runs:
            return
        if key in self._lost:
            self._lost.discard(key)
            self._home.pop(key, None)
            self.lost += 1
            self._done.append(EnvResult(key, error="its worker was replaced (another episode's call hung or "
                                                   "crashed it) and the instance died with it", kind="lost"))
            return
        if key not in self._home:
            load = collections.Counter(self._home.values())
            self._home[key] = min(range(len(self._workers)), key=lambda i: (load[i], i))
        self._queues[self._home[key]].append(("step", key, row, response, state))
        self._dispatch()

    def end(self, key) -> None:
        """Episode ``key`` is over: its instance is dropped (a key never submitted, or lost: nothing to do)."""
        self._lost.discard(key)
        home = self._home.pop(key, None)
        if home is not None:
            self._queues[home].append(("end", key))
            self._dispatch()

    def pending(self) -> int:
        """Calls submitted whose result has not been handed out by ``poll``."""
        return sum(1 for q in self._queues for m in q if m[0] == "step") + sum(
            1 for w in self._workers if w.task) + len(self._done)

    def poll(self, timeout: float = 0.0) -> list[EnvResult]:
        """The results that arrived, in arrival order; waits up to ``timeout`` seconds for a first one."""
        deadline = time.time() + timeout
        while True:
            self._receive(max(0.0, deadline - time.time()) if not self._done else 0.0)
            if self._done or time.time() >= deadline or not self.pending():
                out, self._done = self._done, []
                return out

    def _dispatch(self) -> None:
        """Each ready, idle worker takes the next call of its queue (``end`` messages need no answer)."""
        for i, w in enumerate(self._workers):
            q = self._queues[i]
            while w.ready and w.task is None and q:
                msg = q.popleft()
                w.conn.send(msg)
                if msg[0] == "step":
                    w.task = (msg[1], time.time(), time.time() + self.timeout_s)

    def _receive(self, timeout: float) -> None:
        busy = [w for w in self._workers if w.task or not w.ready]
        deadlines = [w.task[2] for w in busy if w.task]
        if deadlines:
            timeout = min(timeout, max(0.0, min(deadlines) - time.time()))
        for conn in wait([w.conn for w in busy], timeout=timeout) if busy else []:
            i = next(i for i, w in enumerate(self._workers) if w.conn is conn)
            w = self._workers[i]
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the worker died (os._exit, a crash in C code, OOM)
                self._fail(i, "error", f"its worker died (exit code {w.exitcode})")
                continue
            if msg[0] in ("ready", "failed"):
                w.ready = msg[0] == "ready"
                if not w.ready:
                    self._fail(i, "error", f"a replacement worker failed to start: {msg[1]}")
                continue
            key, ok, value, tb, state, seconds = msg  # (the worker's own time: an answer may wait to be collected)
            w.task = None
            self.seconds += seconds
            if ok:
                self._done.append(EnvResult(key, value, seconds=seconds, state=state if isinstance(
                    state, bytes) else None, state_error=state if isinstance(state, str) else ""))
            else:
                self.errors += 1
                self._home.pop(key, None)
                self._done.append(EnvResult(key, error=value, kind="error", seconds=seconds))
                self._log_traceback(tb)
        now = time.time()
        for i, w in enumerate(self._workers):
            if w.task and w.task[2] <= now:
                self._fail(i, "timeout", f"step ran past env.timeout_s={self.timeout_s:g}s; its worker was killed")
        self._dispatch()

    def _fail(self, i: int, kind: str, why: str) -> None:
        """Worker ``i`` is replaced: its call fails (``kind``), the other episodes it held are lost."""
        w = self._workers[i]
        if w.task:
            key, started, _ = w.task
            self.seconds += time.time() - started
            if kind == "timeout":
                self.timeouts += 1
            else:
                self.errors += 1
            self._home.pop(key, None)
            self._done.append(EnvResult(key, error=why, kind=kind, seconds=time.time() - started))
            log.warning("environment: episode %s: %s", key, why)
        held = {k for k, home in self._home.items() if home == i}
        for msg in self._queues[i]:  # queued calls of episodes it held: their instance is gone
            if msg[0] == "step":
                self.lost += 1
                held.discard(msg[1])
                self._done.append(EnvResult(msg[1], error="its worker was replaced and the instance died with it",
                                            kind="lost"))
        for key in [k for k, home in self._home.items() if home == i]:
            del self._home[key]
        self._lost |= held
        self._queues[i].clear()
        w.kill()
        self._workers[i] = self._start()

    def _log_traceback(self, text: str) -> None:
        """The first failed call's full traceback (file and line in the environment's own code), once per pool."""
        if text and not self.traceback_logged:
            self.traceback_logged = True
            log.error("environment: a call of env.fn=%r failed; its traceback (shown once; later failures are "
                      "counted in env/errors):\n%s", self.spec, text.rstrip())

    def metrics(self) -> dict[str, float]:
        """Cumulative counts (``env/*``) and the seconds calls took (``timing/env_s``, since the last call)."""
        out = {"env/calls": float(self.calls), "env/errors": float(self.errors), "env/timeouts": float(self.timeouts),
               "env/lost": float(self.lost), "env/resumed": float(self.resumed),
               "env/restarted": float(self.restarted), "timing/env_s": self.seconds}
        self.seconds = 0.0
        return out

    COUNTS = ("calls", "errors", "timeouts", "lost", "resumed", "restarted")

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.COUNTS}

    def load_state_dict(self, state: dict) -> None:
        for k in self.COUNTS:
            setattr(self, k, state.get(k, 0))  # (a checkpoint before resumed/restarted were counted: 0)

    def close(self) -> None:
        close_workers(self._workers)
        self._workers = []


if __name__ == "__main__":  # a worker: python -m megarl.envs.pool FD SPEC TOOLS PARENT_PID
    _serve(Connection(int(sys.argv[1])), sys.argv[2], sys.argv[3], int(sys.argv[4]))
