"""The engine interface: what the rest of megarl holds of a run's engines. Engines generate; they never schedule.

Two faces:

- ``Engines``: the run's engines as one object, whatever their placement (``colocated.ColocatedEngines``: vLLM in
  the trainer's own processes, one engine or world/TP replicas; ``remote.replicas.EngineReplicas``: replicas in
  processes of their own). The session holds it; the loop, the weight sync and the keeper call it, and nothing
  outside ``engines/`` asks which kind it holds.
- ``SlotEngine``: the SortedRL controller's step-driven face of one engine (``submit`` a ``SlotRequest`` into a free
  slot, ``step`` → a ``StepReport`` of ``TokenEvent``s, ``abort``), implemented by the vLLM engines and by the
  simulator's engines (``rollout.sim.engines``), so the same controller code drives either.

The requests and outputs themselves are boundary types (``megarl.types``). Nothing here imports vLLM.
"""

from __future__ import annotations

from typing import Protocol

import torch

from megarl.types import Completion, GenerationRequest, SlotRequest, StepReport
from megarl.weight_sync.load import LoadReport
from megarl.weight_sync.streaming import StreamingSync


class SlotEngine(Protocol):
    slots: int
    """Concurrent sequences the engine decodes (its batch capacity)."""

    def submit(self, request: SlotRequest) -> None: ...

    def abort(self, request_ids: list[str]) -> None: ...

    def step(self) -> StepReport: ...

    def num_active(self) -> int: ...

    def reset(self) -> None:
        """Forget every request (the engine under it was restarted)."""

    def reseed(self, seed: int) -> None:
        """Sample from a stream of ``seed`` from now on (a phase's seed; engines that share the process's RNG
        stream, reseeded by the loop, ignore it)."""


class Engines(Protocol):
    """A run's engines: colocated (in the trainer's processes) or replicas in processes of their own."""

    dtype: torch.dtype
    """The dtype of the engines' weights (``engine.dtype`` as resolved): the sync casts its buckets to it."""

    def slot_engines(self) -> list[SlotEngine]:
        """The controller's faces of these engines on this rank (none on a trainer rank that drives no engine)."""

    def generate(self, requests: list[GenerationRequest], seed: int) -> list[list[Completion]]:
        """Whole batches (evaluation, the sync's audit): every completion of each request, in request order, on
        every trainer rank. Collective."""

    def load(self, stream: StreamingSync, version: int, in_flight: bool = False) -> LoadReport:
        """The trainer's weights streamed into every engine as ``version``: all or nothing per engine (a failure
        raises ``WeightLoadError`` and leaves the old weights served, or the engine unusable with
        ``sync.rollback: resync``); the prefix cache dropped and the served version bumped on success.
        ``in_flight``: between two engine steps, requests running on (else ``SyncError`` while any runs).
        Collective."""

    def served_versions(self) -> list[int]:
        """The weight version each engine serves (``UNUSABLE`` for one whose load failed with no backup)."""

    def restart(self) -> None:
        """After an engine error: the engines back to idle (fresh, or recovered in place; ``EngineRestartRefused``
        when that cannot be done in this process). The caller then loads the trainer's weights. Collective."""

    def sleep(self) -> None:
        """Free the engines' device memory while the trainer trains (``engine.sleep_level``; a no-op where
        engines have devices of their own or the platform has no sleep mode)."""

    def wake(self) -> None:
        """Undo ``sleep`` before the next load."""

    def close(self) -> None:
        """End the engines (and their processes)."""


class EngineRestartRefused(RuntimeError):
    """The engines failed and cannot be restarted in this process (see ``VLLMEngine.restart``): the run saves and
    stops, and the same command resumes it in fresh processes."""


class TrackedRequests:
    """The request ids a slot engine has in flight (a base of the vLLM ``SlotEngine``s): ``abort`` passes on only
    those (``_abort``), ``reset`` forgets them all after the engine under it was restarted."""

    def __init__(self) -> None:
        self._active: set[str] = set()

    def _abort(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def abort(self, request_ids: list[str]) -> None:
        ids = [r for r in request_ids if r in self._active]
        if ids:
            self._abort(ids)
        self._active.difference_update(ids)

    def num_active(self) -> int:
        return len(self._active)

    def reset(self) -> None:
        self._active.clear()

    def reseed(self, seed: int) -> None:
        pass
