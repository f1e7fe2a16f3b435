"""Preemption signals: SIGTERM and SIGUSR1 (what Slurm sends before it kills or requeues a job) set a flag;
the loop checks it at the next safe point (between steps, every rank agreeing through one all-reduce), saves a
run checkpoint and exits 0.

Slurm signals *every* process of the job step, so the processes a trainer starts must not die of it (megatron's
checkpoint writer keeps a spawned Manager process from the first save on; a dead one fails the preemption's save):
the main thread blocks both signals, which every process it starts afterwards inherits (blocked, they never arrive
there), and a thread of ours takes them with ``sigwait`` (the Python handlers stay for a signal delivered to
another thread).
"""

from __future__ import annotations

import signal
import threading

from megarl.distributed.collectives import any_rank

_signalled = ""  # the preemption signal this process received ('' none)


def signalled() -> str:
    """The preemption signal this process received ('' none): for waits that must not outlast one."""
    return _signalled


class Preemption:
    """SIGTERM / SIGUSR1 → ``requested``; ``due()`` is the same answer on every rank."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    _waiter: threading.Thread | None = None  # one per process: takes the signals the main thread blocks
    _current: Preemption | None = None  # the instance the waiter reports to (the latest installed)

    def __init__(self) -> None:
        self.received: str = ""  # the latest signal taken
        self.seen: set[str] = set()  # every signal taken (two may be taken in either order, by two threads)
        self.install()

    def install(self) -> None:
        """(Re)install the handlers (after anything that may have set its own, e.g. an engine restart)."""
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)
        if threading.current_thread() is threading.main_thread():
            # multiprocessing's resource tracker, at its first start, unblocks SIGTERM in the thread that started
            # it: started first, so that the block below holds for every process this thread starts later
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
            signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)  # inherited by what this thread starts
            if Preemption._waiter is None:
                Preemption._waiter = threading.Thread(target=Preemption._wait, daemon=True, name="megarl-preemption")
                Preemption._waiter.start()
        Preemption._current = self

    @staticmethod
    def _wait() -> None:
        while True:
            signum = signal.sigwait(Preemption.SIGNALS)
            Preemption._current._handle(signum, None)

    def _handle(self, signum, frame) -> None:
        global _signalled
        self.received = _signalled = signal.Signals(signum).name
        self.seen.add(self.received)

    def due(self) -> bool:
        """Whether any rank got a signal (an all-reduce: call it on every rank at the same point)."""
        return any_rank(bool(self.received))
