"""What the trainer and a replica process say to each other: one typed message per command, one per reply.

Every command goes over the replica's connection (a pipe, or a TCP link to another node) as one of the
dataclasses below; the replica answers those marked *reply* with the reply type named. ``Submit`` and ``Abort``
have no reply (the controller's next ``Step`` reports their effect); ``Update``'s reply comes after the transfer.
The client gathers the requests the controller submits between two commands into one ``Submit`` sent before the
next one (a message per request woke the replica for each).

| command | reply |
| --- | --- |
| ``Submit(requests)`` | none |
| ``Seed(seed)`` | none (the engine's sampling stream from here on) |
| ``Abort(request_ids)`` | none |
| ``Step()`` | ``StepDone(events, elapsed, version, routes, route_rows)`` |
| ``Generate(requests, seed)`` | ``list[list[Completion]]`` |
| ``InitTransfer(info)`` | ``Outcome`` |
| ``Update(plan, groups, dtype, version, rollback, stage_only)`` | ``Updated`` |
| ``LoadAdapter(tensors, config, version, in_flight)`` | ``Updated`` |
| ``RecvRaw(plan, sources, dtype)`` | ``int`` (bytes received) |
| ``Close()`` | ``Outcome`` |

A replica that refuses to generate (its last update failed with no backup) answers ``Step`` and ``Generate``
with an ``EngineUnusable`` instead. At start it sends ``Outcome`` once: ready, or why it could not start.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megarl.types import GenerationRequest, SlotRequest, TokenEvent


@dataclass(frozen=True)
class Submit:
    requests: list[SlotRequest]


@dataclass(frozen=True)
class Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class Step:
    pass


@dataclass(frozen=True)
class Seed:
    seed: int


@dataclass(frozen=True)
class Generate:
    requests: list[GenerationRequest]
    seed: int


@dataclass(frozen=True)
class InitTransfer:
    info: dict  # the transfer groups, world size, this replica's first rank, backend, timeout (``transfer``)


@dataclass(frozen=True)
class Update:
    plan: list  # per bucket: its (HF name, shape) pieces
    groups: list[int]  # per bucket: the transfer group (sending trainer rank) it comes over
    dtype: str  # the buckets' dtype ('float32', 'bfloat16', ...)
    version: int  # the weight version the replica serves once loaded
    rollback: str  # 'copy' (back up first) | 'resync' (no backup: unusable if the load fails)
    stage_only: bool = False  # the bench's transfer-only figure: received and staged, nothing loaded
    in_flight: bool = False  # between two engine steps with requests running (rollout.overlap=async): they go on


@dataclass(frozen=True)
class LoadAdapter:
    """LoRA: the trainer's adapters, served from now on as ``version`` (the base weights stay)."""

    tensors: dict  # PEFT name → (dtype, shape, bytes): ``weight_sync.adapter_load.packed``
    config: dict  # the ``adapter_config`` (rank, alpha, target modules)
    version: int
    in_flight: bool = False  # requests running go on under the new adapter (``Update.in_flight``)


@dataclass(frozen=True)
class RecvRaw:
    plan: list
    sources: list[int]
    dtype: str


@dataclass(frozen=True)
class Close:
    pass


@dataclass(frozen=True)
class Outcome:
    """'' when the command succeeded, else why not."""

    error: str = ""


@dataclass(frozen=True)
class StepDone:
    events: list[TokenEvent]
    elapsed: float
    version: int
    # routing replay: the events' routes as one array and each event's rows, in order (an array per event pickled
    # at ~10 µs each: 3 ms a step of 256 requests); ``routes_of`` puts them back on the events
    routes: np.ndarray | None = None
    route_rows: list[int] | None = None

    @staticmethod
    def packed(events: list[TokenEvent], elapsed: float, version: int) -> StepDone:
        """The reply with the events' routes moved into one array (the events keep their ``route_start``)."""
        rows = [0 if ev.routes is None else len(ev.routes) for ev in events]
        if not any(rows):
            return StepDone(events, elapsed, version)
        routes = np.concatenate([ev.routes for ev in events if ev.routes is not None])
        for ev in events:
            ev.routes = None
        return StepDone(events, elapsed, version, routes, rows)

    def routes_of(self) -> list[TokenEvent]:
        """The events, each with its routes again (views of the one array)."""
        if self.routes is not None:
            at = 0
            for ev, n in zip(self.events, self.route_rows):
                if n:
                    ev.routes, at = self.routes[at:at + n], at + n
        return self.events


@dataclass(frozen=True)
class Updated:
    """An ``Update``'s outcome: ``error`` '' when loaded; the replica's version either way."""

    version: int
    error: str = ""
    backup_mib: float = 0.0
    seconds: float = 0.0
    phases: dict = field(default_factory=dict)  # vLLM's load, waiting for buckets, snapshot, CPU time (bench)
