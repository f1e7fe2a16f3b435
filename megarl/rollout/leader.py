"""The SortedRL controller on rank 0, with several trainer processes: every rank learns each phase.

::

    rank 0 (leader)                        rank r > 0
      controller.run_phase ─▶ engines        (no engine handles)
      (groups, metrics) ──broadcast_object──▶ the same (groups, metrics): it trains on them
      engine error ──────broadcast_object──▶ the same error: every rank's RunKeeper restarts + resyncs

With one trainer process it is the plain controller.
"""

from __future__ import annotations

from megarl.distributed.collectives import rank_and_world, share
from megarl.engines.remote.client import EngineDied
from megarl.rollout.controller import RolloutController


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
            except Exception as exc:  # noqa: BLE001  (every rank raises it: the keeper's containment)
                share(("error", f"{type(exc).__name__}: {exc}"))
                raise
        payload = share(payload)
        if payload[0] == "error":
            raise EngineDied(f"on trainer rank 0: {payload[1]}")
        return payload[1]
