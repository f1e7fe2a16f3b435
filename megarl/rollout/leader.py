"""The SortedRL controller on rank 0, with several trainer processes: every rank learns each phase.

::

    rank 0 (leader)                        rank r > 0
      controller.run_phase ─▶ engines        (no engine handles)
      (groups, metrics) ──broadcast_object──▶ the same (groups, metrics), the samples without their routes:
                                             it trains on them (rank 0 sends each rank its share of the routes
                                             once the batch is known: ``PolicyTrainer.hold_routes``)
      engine error ──────broadcast_object──▶ the same error: every rank's RunKeeper restarts + resyncs
      preemption ────────broadcast_object──▶ the same stop (``PhaseStopped``): every rank saves and exits

With one trainer process it is the plain controller.
"""

from __future__ import annotations

from dataclasses import replace

from megarl.distributed.collectives import rank_and_world, share
from megarl.engines.remote.client import EngineDied
from megarl.rollout.controller import RolloutController
from megarl.rollout.phase import PhaseStopped


class LeaderController(RolloutController):
    """The SortedRL controller on rank 0, whose phases every trainer rank receives (see the module docstring)."""

    def generate(self, version: int):
        """The phase on rank 0 alone (the pipeline's thread, which shares nothing: the trainer's thread does)."""
        return super().run_phase(version)

    def run_phase(self, version: int):
        rank, world = rank_and_world()
        if world == 1:
            return self.generate(version)
        payload = None
        if rank == 0:
            try:
                payload = ("ok", self.generate(version))
            except PhaseStopped as stop:  # (a preemption: every rank saves and stops)
                share(("stopped", stop.args[0]))
                raise
            except Exception as exc:  # noqa: BLE001  (every rank raises it: the keeper's containment)
                share(("error", f"{type(exc).__name__}: {exc}"))
                raise
        # the other ranks' samples without their routes: rank 0 sends each its share once the batch is known
        # (``PolicyTrainer.hold_routes``), not every route to every rank
        mine, payload = payload, share(without_routes(payload) if rank == 0 else None)
        if payload[0] == "stopped":
            raise PhaseStopped(payload[1])
        if payload[0] == "error":
            raise EngineDied(f"on trainer rank 0: {payload[1]}")
        return (mine if rank == 0 else payload)[1]


def without_routes(payload: tuple) -> tuple:
    """An ``("ok", (groups, metrics))`` payload with copies of the samples that carry no routes."""
    kind, (groups, metrics) = payload
    return kind, (groups_without_routes(groups), metrics)


def groups_without_routes(groups: list) -> list:
    """Copies of ``groups`` whose samples carry no routes (what the other trainer ranks receive)."""
    return [replace(g, samples=[replace(s, routes=None) for s in g.samples]) for g in groups]
