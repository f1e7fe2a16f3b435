"""``engine.placement: colocated``: vLLM inside the trainer's processes (``ColocatedEngines``, the run's ``Engines``).

One engine spans the world (engine TP = world, or world 1), or, with ``engine.tensor_parallel_size`` < the world,
world/TP engine replicas inside the trainer's processes, driven as one slot engine (``ColocatedReplicas``) so that
every rank's controller stays in lockstep.

::

    rank      0     1     2     3        world 4, engine TP 2: replica k = ranks [k·TP, (k+1)·TP)
    replica   0     0     1     1        (vLLM's external_launcher builds the same TP groups)

    controller (the same on every rank)
      submit(request) ──► the least-loaded replica (lowest index on ties); only its ranks add it
      step()          ──► every replica with work steps its own engine ─► its events
                          ─► all_gather_object over the world ─► one copy per replica (its first
                          rank), in replica order ─► the same StepReport on every rank (MoE routes:
                          gathered to rank 0 alone, the only rank that keeps them)

Each rank's engine holds the full weights its TP shard needs (the streaming sync feeds every
rank). Every event carries its replica's weight version. Replicas sample from streams of their
own (derived from the loop's per-step seed and the replica index; the CPU's and, on GPUs, the
device's), so two samples of one prompt that run on two replicas are not the same sample twice.
An engine error on any replica is raised on every rank after the exchange, so every rank's keeper
handles it at the same step and every rank recovers its engine in place (``VLLMEngine.restart`` under torchrun).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from megarl.distributed.rng import seeded_rng_state
from megarl.engines.memory import EngineSleep
from megarl.engines.protocol import SlotEngine
from megarl.engines.vllm_engine import VLLMEngine, VLLMSlotEngine
from megarl.types import Completion, GenerationRequest, SlotRequest, StepReport
from megarl.weight_sync.adapters import AdapterStream
from megarl.weight_sync.load import LoadReport
from megarl.weight_sync.streaming import StreamingSync

_SEED_STRIDE = 1_000_003


class ColocatedReplicas:
    """``SlotEngine`` over world/TP colocated replicas (``local``: this rank's ``VLLMSlotEngine``)."""

    def __init__(self, local, tensor_parallel_size: int, rank: int | None = None, world: int | None = None) -> None:
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size() if world is None else world
        if tensor_parallel_size < 1 or self.world % tensor_parallel_size:
            raise ValueError(f"engine TP {tensor_parallel_size} must divide the world size {self.world}")
        self.local, self.tp = local, tensor_parallel_size
        self.replicas, self.replica = self.world // tensor_parallel_size, self.rank // tensor_parallel_size
        self.slots = local.slots * self.replicas
        self.owner: dict[str, int] = {}  # request id → replica serving it
        self.load = [0] * self.replicas  # requests in flight per replica (the same on every rank)
        self.submitted = [0] * self.replicas  # requests each replica was given over the run
        self._seed: int | None = None  # the loop's seed the replica stream was derived from
        self._rng: torch.Tensor | None = None  # this replica's sampling RNG state
        self._cuda_rng: torch.Tensor | None = None  # and on a GPU, its device's (vLLM samples there)

    @property
    def engine(self):
        return self.local.engine

    def submit(self, request: SlotRequest) -> None:
        self.engine.refuse_if_unusable()  # every rank alike (a failed load marks every rank's engine)
        k = min(range(self.replicas), key=lambda r: (self.load[r], r))
        self.owner[request.request_id] = k
        self.load[k] += 1
        self.submitted[k] += 1
        if k == self.replica:
            self.local.submit(request)

    def abort(self, request_ids: list[str]) -> None:
        mine = [r for r in request_ids if self.owner.get(r) == self.replica]
        if mine:
            self.local.abort(mine)
        for r in request_ids:
            k = self.owner.pop(r, None)
            if k is not None:
                self.load[k] -= 1

    def num_active(self) -> int:
        return sum(self.load)

    def reset(self) -> None:
        """Forget every request (the engines were restarted)."""
        self.local.reset()
        self.owner.clear()
        self.load = [0] * self.replicas

    def reseed(self, seed: int) -> None:
        pass  # the replicas derive their streams from the loop's seed (``_step_local``)

    def step(self) -> StepReport:
        mine, error = StepReport([], 0.0, 0), ""
        if self.load[self.replica]:
            try:
                mine = self._step_local()
            except Exception as exc:  # noqa: BLE001  (raised on every rank below, after the exchange)
                error = f"replica {self.replica} (rank {self.rank}): {type(exc).__name__}: {exc}"
        routes = {ev.request_id: (ev.route_start, ev.routes) for ev in mine.events if ev.routes is not None}
        bare = [replace(ev, routes=None) for ev in mine.events] if routes else mine.events
        every = [None] * self.world
        dist.all_gather_object(every, (bare, mine.elapsed, mine.active, error, bool(routes)))
        errors = [e for *_, e, _ in every if e]
        if errors:
            raise RuntimeError("colocated engine step failed: " + "; ".join(errors))
        events, elapsed, active = [], 0.0, 0
        for k in range(self.replicas):
            evs, el, act, *_ = every[k * self.tp]  # one copy per replica: its first rank's
            events += evs
            elapsed, active = max(elapsed, el), active + act
            for ev in evs:
                if ev.finished and self.owner.pop(ev.request_id, None) is not None:
                    self.load[k] -= 1
        if any(every[k * self.tp][-1] for k in range(self.replicas)):
            self._routes_to_rank_0(events, routes)
        return StepReport(events, elapsed, active)

    def _routes_to_rank_0(self, events: list, routes: dict) -> None:
        """Routing replay: the step's routes go to rank 0 alone, which keeps the samples' routes and sends each
        trainer rank its share of a batch (``PolicyTrainer.hold_routes``); the other ranks' samples carry none
        (every rank received every route before, ~0.75 KB a token at Qwen3-235B's 94 layers)."""
        first = self.rank % self.tp == 0  # (a replica's ranks capture the same routes: its first rank's count)
        gathered = [None] * self.world if self.rank == 0 else None
        dist.gather_object(routes if first else {}, gathered, dst=0)
        if self.rank == 0:
            held = {rid: r for part in gathered for rid, r in part.items()}
            for ev in events:
                if ev.request_id in held:
                    ev.route_start, ev.routes = held[ev.request_id]

    def generate(self, requests: list, seed: int) -> list:
        """Batch generation (evaluation) shared out: replica k generates requests k, k + R, … (R replicas) on its
        engine, the results are exchanged, and every rank returns all of them in request order."""
        self.engine.refuse_if_unusable()  # every rank alike (a failed load marks every rank's engine)
        share, mine, error = requests[self.replica::self.replicas], [], ""
        try:
            mine = self.engine.generate(share, seed=seed) if share else []
        except Exception as exc:  # noqa: BLE001  (raised on every rank below, after the exchange, as in step)
            error = f"replica {self.replica} (rank {self.rank}): {type(exc).__name__}: {exc}"
        every = [None] * self.world
        dist.all_gather_object(every, (mine, error))
        errors = [e for _, e in every if e]
        if errors:
            raise RuntimeError("colocated engine generation failed: " + "; ".join(errors))
        every = [m for m, _ in every]
        out = [None] * len(requests)
        for k in range(self.replicas):
            out[k::self.replicas] = every[k * self.tp]
        return out

    def _step_local(self) -> StepReport:
        """One step of this rank's engine, sampling from this replica's own RNG streams: the CPU generator's and,
        on a GPU, this device's (vLLM's sampler draws its noise on the logits' device)."""
        seed = torch.initial_seed()
        if seed != self._seed or self._rng is None:  # the loop reseeded (every rank alike): derive anew
            self._seed = seed
            derived = (seed * _SEED_STRIDE + self.replica) % 2**63
            self._rng = torch.Generator().manual_seed(derived).get_state()
            self._cuda_rng = seeded_rng_state(derived) if torch.cuda.is_available() else None
        outer = torch.get_rng_state()
        outer_cuda = torch.cuda.get_rng_state() if self._cuda_rng is not None else None
        torch.set_rng_state(self._rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state(self._cuda_rng)
        try:
            return self.local.step()
        finally:
            self._rng = torch.get_rng_state()
            torch.set_rng_state(outer)
            if outer_cuda is not None:
                self._cuda_rng = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(outer_cuda)


class ColocatedEngines:
    """The run's ``Engines`` when vLLM runs in the trainer's processes: this rank's ``VLLMEngine`` and the
    controller's face of it (the engine itself, or ``ColocatedReplicas``). Every call is made on every rank."""

    def __init__(self, engine: VLLMEngine, slots: int, tensor_parallel_size: int, rollback: str = "copy",
                 sleep_level: int = 0, say=print) -> None:
        """``rollback``: ``sync.rollback`` ('copy': a host backup restores a failed load; 'resync': none);
        ``sleep_level``: ``engine.sleep_level``, ``say`` told once where it cannot apply."""
        self.engine = engine
        self.local = VLLMSlotEngine(engine, slots)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.replicas = ColocatedReplicas(self.local, tensor_parallel_size) if tensor_parallel_size < world else None
        self.sleeper = EngineSleep(engine, sleep_level, say)
        self.rollback = self.sleeper.rollback(rollback)

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    def slot_engines(self) -> list[SlotEngine]:
        return [self.replicas or self.local]

    def generate(self, requests: list[GenerationRequest], seed: int) -> list[list[Completion]]:
        """Replicas share the requests out (each generates its share, every rank returns all); one engine
        generates them all."""
        if self.replicas is not None:
            return self.replicas.generate(requests, seed)
        return self.engine.generate(requests, seed)

    def load(self, stream: StreamingSync | AdapterStream, version: int, in_flight: bool = False) -> LoadReport:
        self.engine.idle_or_refuse()
        if isinstance(stream, AdapterStream):  # LoRA: the adapters alone, a new vLLM adapter (no backup needed)
            self.engine.load_adapter(stream.tensors(), stream.config, version)
            return LoadReport()
        # zero_copy: on one rank, tensors that need no re-layout go to the engine as views of the trainer's own
        backup = self.engine.load(stream.weights(zero_copy=True), version, self.rollback)
        return LoadReport(backup_mib=backup / 2**20)

    def served_versions(self) -> list[int]:
        return [self.engine.weight_version]

    def restart(self) -> None:
        self.engine.restart()  # under torchrun: recovered in place, or refused (every rank alike)
        for face in self.slot_engines():
            face.reset()

    def sleep(self) -> None:
        self.sleeper.sleep()

    def wake(self) -> None:
        self.sleeper.wake()

    def close(self) -> None:
        pass  # the engine lives as long as the trainer's process (vLLM ends it at exit)
