"""Who waits for whom: the generation of rollout batches beside the training of the last one (``rollout.overlap``).

Timelines of one engine (E) and one trainer (T); g_b generates batch b, t_b trains it (v_b → v_b+1), s_v syncs v::

    none       E  g0 ·········· g1 ·········· g2          every phase with the newest weights (staleness 0)
               T  ···· t0 s1 ······· t1 s2 ·······
    one_step   E  g0 g1 ······· g2 ······· g3             g_b+1 runs with v_b while t_b trains;
               T  ·· t0 ··· s1 t1 ··· s2 t2 ···            weights move at the phase boundary (staleness 1)
    async      E  g0 g1 g2 │g3 g4 │g5 ...                 never waits: batches queue, s_v loads between two
               T  ·· t0 s1 t1 s2 t2 s3 ...                 engine steps (│), no drain; g_b starts only while
                                                           the engines hold v ≥ b − k (k = rollout.staleness_limit)

The generating side runs in a thread of rank 0 (it only talks to the engine replicas, processes of their own);
the trainer's main thread pulls batches, shares each with every rank, trains and syncs. Invariants:

1. Every batch is exactly one controller phase (``prompts_per_step`` useful groups, the controller's contract).
2. Every trained token was sampled at most k versions before the version that trains it (one_step: 1): a phase
   for batch b starts only when the engines hold v ≥ b − k (async) and at b − 1 (one_step); resumed samples older
   than that are expired by the phase (``rollout.stale_action``). Per sample, partial admission keeps no more
   groups live than the batches within k of the engines' version take (``Phase.room``, via ``engine_version``).
3. No prompt lost or trained twice: queued batches and the controller are checkpointed together, at a point where
   no phase runs (``hold``); a phase that fails is put back as the keeper puts back a failed phase.
4. The engines see one driver at a time: the generating thread between engine steps, or an in-flight sync
   (``EngineGate``).
5. ``async`` with k = 0 makes exactly the calls of ``none``, in the same order (a phase for batch b waits for v_b).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from megarl.rollout.phase_metrics import PhaseMetrics
from megarl.types import Group

log = logging.getLogger(__name__)


@dataclass
class Rollout:
    """One batch: its groups, the phase's metrics, the reward and data figures of its generation."""

    groups: list[Group]
    phase: PhaseMetrics
    metrics: dict = field(default_factory=dict)
    batch: int = 0  # its index: the number of batches generated before it


def staleness(groups: list[Group], version: int) -> collections.Counter:
    """Tokens by how many versions before ``version`` (the one training them) they were sampled."""
    out: collections.Counter = collections.Counter()
    for g in groups:
        for s in g.samples:
            out.update(version - v for v in s.versions)
    return out


class EngineGate:
    """One driver of the engines at a time: the generating thread for each engine step (``step``), or the trainer's
    main thread for a weight sync between two of them (``exclusive``, which waits for one step, never a phase)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._owner = ""
        self._wanted = 0

    @contextlib.contextmanager
    def step(self):
        with self._cond:
            while self._owner == "sync" or self._wanted:
                self._cond.wait()
            self._owner = "step"
        try:
            yield
        finally:
            self._release()

    @contextlib.contextmanager
    def exclusive(self):
        with self._cond:
            self._wanted += 1
            while self._owner:
                self._cond.wait()
            self._wanted -= 1
            self._owner = "sync"
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        with self._cond:
            self._owner = ""
            self._cond.notify_all()


class Pipeline:
    """The batches of rank 0's controller in ``mode``. ``generate(version, batch)`` runs one phase for batch ``batch``,
    trained at ``version``, and returns its ``Rollout`` (putting the controller back itself when the phase fails);
    the trainer's thread calls ``take``, ``after_take``, ``sync``, ``step_done`` once per step and ``hold`` around
    whatever needs idle engines. Only rank 0 (``leader``) runs a thread; the caller shares what ``take`` gives."""

    def __init__(self, mode: str, generate: Callable[[int, int], Rollout], staleness_limit: int,
                 leader: bool = True) -> None:
        self.mode, self.generate, self.k, self.leader = mode, generate, staleness_limit, leader
        self.gate = EngineGate()
        self.queue: collections.deque[Rollout] = collections.deque()
        self.generated = 0  # batches generated (the next one's index)
        self.done = 0  # steps finished (their batch trained, the weights synced or not)
        self.version = 0  # the policy's version once ``done`` steps are done (the weights the engines serve)
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._held = 0
        self._stop = False
        self._busy = False  # a phase runs in the thread

    # ---- the trainer's side (main thread) ---------------------------------------------------------------------
    def take(self) -> tuple[Rollout | None, BaseException | None]:
        """The next batch generated ahead (waited for), or None: the caller generates it now (``generated_now``);
        or the error its generation raised (the controller was put back; the caller recovers, then generates it)."""
        if self.mode == "none" or not self.leader:
            return None, None
        if self.mode == "one_step":
            self._join()
            if (error := self._pop_error()) is not None:
                return None, error
            return (self.queue.popleft() if self.queue else None), None
        self._ensure_thread()
        with self._cond:
            while not self.queue and self.error is None:
                self._cond.wait()
            if self.queue:
                return self.queue.popleft(), None
            return None, self._pop_error()

    def generated_now(self) -> None:
        """The caller generated the batch ``take`` did not have: it counts as the next one."""
        self.generated += 1

    def after_take(self) -> None:
        """one_step: start generating the next batch, with the engines' weights now, while this one trains."""
        if self.mode == "one_step" and self.leader and not self._stop:
            self._start(self._phase, self.generated)

    def boundary(self) -> BaseException | None:
        """Before a weight sync: one_step waits for the phase in flight (the phase boundary) and gives its error."""
        if self.leader and self.mode == "one_step":
            self._join()
            return self._pop_error()
        return None

    @contextlib.contextmanager
    def sync(self):
        """Around a weight sync: async takes the engines between two engine steps (none runs inside) and yields
        whether a phase is in flight (its requests go on under the new weights); otherwise the engines are idle."""
        if not (self.leader and self.mode == "async"):
            yield False
            return
        with self.gate.exclusive():
            with self._cond:
                in_flight = self._busy
            yield in_flight

    def step_done(self, version: int) -> None:
        """A step has trained its batch (and synced, or not: ``version`` is the policy's now): async may start the
        phase ``staleness_limit`` ahead."""
        with self._cond:
            self.done += 1
            self.version = version
            self._cond.notify_all()

    @contextlib.contextmanager
    def hold(self):
        """No phase runs inside (evaluations, checkpoints): the one in flight ends first, none starts until the end."""
        if not self.leader or self.mode == "none":
            yield
            return
        if self.mode == "one_step":
            self._join()
            yield
            return
        with self._cond:
            self._held += 1  # (holds nest: a save inside an end of step that holds)
            while self._busy:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._held -= 1
                self._cond.notify_all()

    def stop_ahead(self) -> None:
        """The thread ends after the phase in flight (its error, if any, dropped: the controller is already put
        back); the next ``take`` starts it again. For an engine restart, which needs idle engines."""
        self.close()
        self._stop = False
        self._pop_error()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._join()

    def engine_version(self, _now: float = 0.0) -> int:
        """The weights the engines serve (the controller's ``engine_version``; a load in flight counts once its step
        is done: until then the lag reads one too many, which only admits less)."""
        return self.version

    def queued_groups(self) -> int:
        return sum(len(r.groups) for r in self.queue)

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The batches generated ahead and the counts (call inside ``hold``: no phase runs)."""
        return {"queue": pickle.dumps(list(self.queue)), "generated": self.generated, "done": self.done,
                "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.queue = collections.deque(pickle.loads(state["queue"]))
        self.generated, self.done, self.version = state["generated"], state["done"], state["version"]

    # ---- the generating side (rank 0's thread) ----------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if not self._running():
            self._start(self._loop)

    def _start(self, target, *args) -> None:
        self._thread = threading.Thread(target=target, args=args, name=f"megarl-rollout-{self.mode}", daemon=True)
        self._thread.start()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _pop_error(self) -> BaseException | None:
        with self._cond:
            error, self.error = self.error, None
        return error

    def _phase(self, batch: int) -> bool:
        """Generate batch ``batch`` (trained at the engines' version plus the steps until its turn) into the queue;
        False after an error (kept for the trainer's thread)."""
        with self._cond:
            self._busy = True
            version = self.version + (batch - self.done)
        try:
            rollout = self.generate(version, batch)
        except BaseException as exc:  # noqa: BLE001  (given to the trainer's thread, where the keeper contains it)
            with self._cond:
                self.error = exc
            return False
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        with self._cond:
            self.queue.append(rollout)
            self.generated = batch + 1
            self._cond.notify_all()
        return True

    def _loop(self) -> None:
        """async: phases back to back, each as soon as its batch would train at most k versions after the engines'."""
        while True:
            with self._cond:
                while not self._stop and (self._held or self.generated - self.done > self.k):
                    self._cond.wait()
                if self._stop:
                    return
                batch = self.generated
            if not self._phase(batch):
                return
