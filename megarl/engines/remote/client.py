"""The trainer's handle on one disaggregated replica process: a ``SlotEngine`` over a connection.

The connection is a pipe for a replica spawned on rank 0's node, or a TCP link for one spawned on
another node (``nodes``); either way one command goes out and (for most) one answer comes back.
A connection that breaks is ``EngineDied`` — an engine error the loop's containment restarts the
replicas for — and an answer that is ``EngineUnusable`` (the replica's last update failed with no
backup, ``sync.rollback: resync``) is raised here on the trainer. ``DeathWatch`` ends every replica
as soon as one dies during a sync, so no blocked transfer waits for its timeout.
"""

from __future__ import annotations

import threading

from megarl.distributed.watchdog import guard
from megarl.engines.protocol import TrackedRequests
from megarl.engines.remote import nodes
from megarl.engines.remote.messages import Abort, Seed, Step, Submit
from megarl.types import SlotRequest, StepReport
from megarl.weight_sync.load import UNUSABLE, EngineUnusable


class EngineDied(RuntimeError):
    """A replica process is gone; an engine error the loop's containment restarts the replicas for."""


class ReplicaClient(TrackedRequests):
    """The trainer's handle on one replica: a ``SlotEngine`` over a pipe or a TCP link."""

    def __init__(self, index: int, conn, proc, slots: int) -> None:
        self.index, self.conn, self.proc, self.slots = index, conn, proc, slots
        self.weight_version = 0
        self._pending: list[SlotRequest] = []  # submitted since the last command: sent before the next one
        super().__init__()

    def call(self, msg, reply: bool = True):
        """Send one command (``messages.py``) and wait for its reply, or raise ``EngineDied`` if the process is gone."""
        try:
            with guard(f"engine replica {self.index}: {type(msg).__name__}"):  # never answering → exit 75 (watchdog)
                if self._pending:
                    pending, self._pending = self._pending, []
                    self.conn.send(Submit(pending))
                self.conn.send(msg)
                answer = self.conn.recv() if reply else None
        except (OSError, EOFError) as exc:  # a broken pipe, a reset or ended link
            self.proc.join(1)
            raise EngineDied(f"engine replica {self.index} ({nodes.where(self.proc)}) is not running "
                             f"(exit code {self.proc.exitcode})") from exc
        if isinstance(answer, EngineUnusable):  # its last update failed with no backup (sync.rollback=resync)
            raise EngineUnusable(f"engine replica {self.index}: {answer}")
        return answer

    def submit(self, request: SlotRequest) -> None:
        if self.weight_version == UNUSABLE:
            raise EngineUnusable(f"engine replica {self.index} refuses to generate: its last weight update failed "
                                 "with no backup (sync.rollback=resync); it must be re-synced")
        self._pending.append(request)  # (sent with the next command: ``call``)
        self._active.add(request.request_id)

    def reset(self) -> None:
        super().reset()
        self._pending = []

    def reseed(self, seed: int) -> None:
        """The replica's sampling stream from here on (a phase that starts from the same state samples alike)."""
        self.call(Seed(seed), reply=False)

    def _abort(self, request_ids: list[str]) -> None:
        self.call(Abort(request_ids), reply=False)

    def step(self) -> StepReport:
        active = len(self._active)
        done = self.call(Step())
        for ev in done.routes_of():
            if ev.finished:
                self._active.discard(ev.request_id)
        return StepReport(done.events, done.elapsed, active)


class DeathWatch:
    """While a rank-0 sync runs: if a replica process dies, end every replica — their transfer group is
    broken, and ending them makes every blocked send and receive fail at once instead of at the timeout."""

    def __init__(self, replicas) -> None:
        self.replicas, self.done, self.died = replicas, threading.Event(), ""
        self.thread = threading.Thread(target=self._run, name="megarl-replica-deathwatch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.1):
            if why := self.replicas.dead():
                self.died = why
                self.replicas._end_all()
                return

    def stop(self) -> str:
        self.done.set()
        self.thread.join()
        return self.died
