"""``engine.placement: disaggregated``: ``engine.replicas`` vLLM engines, each in a process of its own.

::

    trainer rank 0 (leader)                           replica k (own process, own TP; ``serve``)
      controller ──submit/abort/step (pipe, or TCP)──▶ LLM.llm_engine.add_request / step
      ReplicaClient k  ◀──token events + version──────
      sync: "update" (plan) to every replica ───────▶ LLM.start_weight_update → update_weights → finish
    every trainer sending rank s (rank 0 too)
            GlooSender: flag + bucket, broadcast ════▶ (every worker of every replica; one group per sender)
    rank 0                                     ◀──── ok (+ reset prefix cache, version bump) | failed
      the verdict ──all_gather_object──▶ every trainer rank (all raise, or none)

Each replica is a ``SlotEngine`` (``client.ReplicaClient``); the SortedRL controller on rank 0 drives
them all from one shared pull queue, and the other trainer ranks learn each phase's batch from
it (``rollout/leader.py``). Weights go through vLLM's weight-transfer API with our
``megarl_gloo`` backend (``weight_sync.vllm_backend``; gloo on CPU, NCCL with ``sync.transport: nccl``):
each bucket is broadcast once to all replicas by the trainer rank that owns it
(``StreamingSync.sends``); with LoRA rank 0 sends the adapters alone over each replica's link
(``load_adapters``). A failed update leaves a replica serving its old weights (its own
backup), and it says so. A replica that dies (mid-sync or mid-phase) is an engine error: every
replica is ended (their transfer group is broken), nothing hangs (liveness polling, the group's
``sync.timeout_s``), and the loop's containment restarts them (the keeper's engine-error path).
With ``engine.replica_nodes`` the replicas run on other nodes, spawned there and linked back to
rank 0 over TCP (``nodes``); starting and restarting them is then collective. Engine-only nodes
(``engine.replica_nodes_dedicated``): their replica hosts spawn them at rank 0's word (``host``).
"""

from __future__ import annotations

import atexit
import logging
import math
import multiprocessing as mp
import socket
import time
from dataclasses import dataclass

import torch

from megarl.compat.megatron import cpu_suspended
from megarl.distributed import collectives
from megarl.engines.protocol import SlotEngine
from megarl.engines.remote import nodes, reaper
from megarl.engines.remote.client import DeathWatch, EngineDied, ReplicaClient
from megarl.engines.remote.host import HostPool
from megarl.engines.remote.messages import Close, Generate, InitTransfer, LoadAdapter, RecvRaw, Update
from megarl.engines.remote.process import serve
from megarl.types import Completion, GenerationRequest
from megarl.weight_sync.adapter_load import packed
from megarl.weight_sync.adapters import AdapterStream
from megarl.weight_sync.load import EngineUnusable, LoadReport, SyncError, WeightLoadError
from megarl.weight_sync.streaming import StreamingSync
from megarl.weight_sync.transport import GlooSender, join_group, listen, wire_device

log = logging.getLogger(__name__)


@dataclass
class Generated:
    """A batch generation's result as rank 0 shares it: the completions, or why there are none."""

    completions: list | None = None
    error: str = ""
    unusable: bool = False  # the error is the replica's refusal (its last load failed with no backup)


@dataclass
class Verdict:
    """Rank 0's reading of every replica's reply to an update."""

    failed: list[str]
    versions: list[int]
    backup_mib: float = 0.0
    slowest_update_s: float = 0.0
    slowest_load_s: float = 0.0
    died: bool = False  # a replica died: every replica was ended


class EngineReplicas:
    """The run's ``Engines`` when replicas run in processes of their own: the processes, their weight groups, and
    every call the loop makes on them.

    Every trainer rank builds one: rank 0 (the leader) starts and drives the replica processes
    (``clients``); each trainer rank that owns buckets sends them. With several trainer
    processes ``generate``, ``load`` and ``restart`` are collective calls."""

    def __init__(self, model_dir: str, replicas: int, tensor_parallel_size: int, max_model_len: int,
                 kv_cache_gib: float, slots: int, seed: int = 0, start_timeout_s: float = 600.0,
                 transport: str = "gloo", timeout_s: float = 300.0, devices: str = "", rollback: str = "copy",
                 replica_nodes: int = 0, hosts_file: str = "", dtype: str = "float32", enforce_eager="auto",
                 gpu_memory_utilization: float = 0.0, route_experts: int = 0, cpus: list | None = None,
                 cpu_threads: int = 0, load_format: str = "auto", lora_rank: int = 0,
                 lora_modules: tuple[str, ...] = ()) -> None:
        """``cpus``: the ``CpuShare``s of each replica this rank's node hosts (its workers'), in their order there
        (``distributed.placement``); ``cpu_threads``: ``engine.cpu_threads``, for engine-only nodes to place by;
        ``lora_rank`` > 0: the replicas serve the trainer's LoRA adapters (``load_adapters``) on the HF modules
        ``lora_modules`` over their base."""
        self.clients: list[ReplicaClient] = []
        self.rank, self.world = collectives.rank_and_world()
        self.leader = self.rank == 0
        # who spawns which replica (engine.replica_nodes; collective): rank 0, or the hosting nodes' first ranks
        self._node = nodes.node_index(self.rank)
        # hosts_file (engine.replica_nodes_dedicated): no trainer rank spawns; rank 0 asks the engine nodes' hosts
        self._dedicated, self._hosts_file, self._pool = bool(hosts_file), hosts_file, None
        node_of_ranks = collectives.gather(self._node) if replica_nodes else [0]
        spawners = {} if self._dedicated else nodes.place(replicas, replica_nodes, node_of_ranks)
        self._hosted, self._remote = spawners.get(self.rank, []), self._dedicated or any(r != 0 for r in spawners)
        self._host_nodes = (replica_nodes, max(node_of_ranks) + 1)  # (engine nodes, the first one's index)
        self._local: list = []  # the replica processes this rank spawned for rank 0 (another node's leader)
        self._args = dict(model=str(model_dir), replicas=replicas, tp=tensor_parallel_size,
                          max_model_len=max_model_len, kv_cache_gib=kv_cache_gib, slots=slots, seed=seed,
                          start_timeout_s=start_timeout_s, dtype=dtype, enforce_eager=enforce_eager,
                          gpu_memory_utilization=gpu_memory_utilization, route_experts=route_experts,
                          devices=[d.strip() for d in devices.split(",") if d.strip()], cpus=cpus or [],
                          cpu_threads=cpu_threads, load_format=load_format, lora_rank=lora_rank,
                          lora_modules=list(lora_modules))
        self.transport, self.timeout_s = transport, timeout_s
        self.dtype = getattr(torch, dtype)  # engine.dtype as resolved: the sync's buckets are cast to it
        self.rollback = rollback  # sync.rollback, sent with every update to the replicas' workers
        self.versions = [0] * replicas  # what each replica serves (known on every trainer rank)
        self.senders: list[int] | None = None  # the trainer ranks whose groups the replicas joined
        self.sender = None  # this rank's GlooSender, if it sends
        self.sent_by_rank: list[int] = []  # bytes each trainer rank sent in the last sync
        self.last_phases: list[dict] = []  # rank 0: each replica's phases of the last sync (seconds)
        atexit.register(self.close)
        if self.leader or self._remote:
            self._start()

    def restart(self) -> None:
        """End every replica and start them again (after an engine error); the caller then syncs the weights."""
        self.senders, self.sender = None, None  # the groups are rebuilt at the next sync
        self.versions = [0] * self._args["replicas"]
        if self.leader or self._remote:  # replicas on other nodes: every rank takes part, their leaders respawn
            self.close(hosts=False)
            self._start()

    def _start(self) -> None:
        """Spawn this rank's replicas (rank 0: over pipes; another node's leader: linked to rank 0 over TCP);
        rank 0 waits until every replica is ready. Collective when other nodes host replicas."""
        a = self._args
        replicas, start_timeout_s = a["replicas"], a["start_timeout_s"]
        ctx = mp.get_context("spawn")
        rendezvous = None
        if self._remote:  # rank 0's address and a per-run secret, shared over the trainer's process group
            host = nodes.reachable_host(collectives.gather(socket.gethostname()), elsewhere=self._dedicated)
            rendezvous = nodes.Rendezvous(host) if self.leader else None
            address = collectives.share(rendezvous and rendezvous.address)
        links = {}
        for j, k in enumerate(self._hosted):
            spec = self._spec(k, j)
            if self.leader:
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=serve, args=(child, spec), name=f"megarl-engine-{k}")
                links[k] = (parent, proc)
            else:
                proc = ctx.Process(target=nodes.serve_remote, args=(address, k, self._node, spec),
                                   name=f"megarl-engine-{k}")
                self._local.append(proc)
            proc.start()
        error = None
        if self.leader:
            try:
                if self._dedicated:  # every replica on the engine nodes, spawned by their hosts
                    self._spawn_on_hosts(rendezvous)
                if rendezvous is not None:
                    links.update(rendezvous.accept([k for k in range(replicas) if k not in links], start_timeout_s))
                self._ready(links)
            except Exception as exc:  # noqa: BLE001  (every rank raises it when other nodes host replicas)
                error = f"{type(exc).__name__}: {exc}"
                if rendezvous is not None:
                    rendezvous.listener.close()
        if self._remote:
            error = collectives.share(error)
        if error:  # end what this rank started (a replica whose link rank 0 drops ends itself)
            for proc in [proc for _, proc in links.values()] + self._local:
                _kill(proc)
            self._local = []
            raise RuntimeError(error)

    def _spec(self, k: int, j: int) -> dict:
        """Replica ``k``'s spec, the ``j``-th replica of its node (its slice of ``engine.replica_devices``)."""
        a, tp = self._args, self._args["tp"]
        return dict(model=a["model"], tp=tp, max_model_len=a["max_model_len"], kv_cache_gib=a["kv_cache_gib"],
                    slots=a["slots"], seed=a["seed"] + k, devices=",".join(a["devices"][j * tp:(j + 1) * tp]),
                    dtype=a["dtype"], enforce_eager=a["enforce_eager"],
                    gpu_memory_utilization=a["gpu_memory_utilization"], route_experts=a["route_experts"],
                    cpu_threads=a["cpu_threads"], load_format=a["load_format"], lora_rank=a["lora_rank"],
                    lora_modules=a["lora_modules"],
                    cpus=[(c.threads, c.cores) for c in a["cpus"][j]] if j < len(a["cpus"]) else None)

    def _spawn_on_hosts(self, rendezvous) -> None:
        """Rank 0, dedicated engine nodes: link their hosts (once per run), which then (re)spawn the replicas."""
        count, first = self._host_nodes
        if self._pool is None:
            self._pool = HostPool(self._hosts_file, count, first, rendezvous.address[0], self._args["start_timeout_s"])
        self._pool.spawn(rendezvous.address, [[(k, self._spec(k, j)) for j, k in enumerate(share)]
                                              for share in nodes.shares(self._args["replicas"], count)])

    def _ready(self, links: dict) -> None:
        """Rank 0: the replicas' handles over their new processes, once each said it is ready."""
        start_timeout_s = self._args["start_timeout_s"]
        old = self.clients  # on a restart the controller keeps its handles: they get the new processes
        self.clients = []
        for k in range(self._args["replicas"]):
            conn, proc = links[k]
            if k < len(old):
                c = old[k]
                c.conn, c.proc, c.weight_version = conn, proc, 0
                c.reset()
            else:
                c = ReplicaClient(k, conn, proc, self._args["slots"])
            self.clients.append(c)
            if isinstance(proc, nodes.RemoteProcess):
                log.info(f"megarl: engine replica {k}: {nodes.where(proc)}")
        for c in self.clients:
            if not c.conn.poll(start_timeout_s):
                raise RuntimeError(f"engine replica {c.index} ({nodes.where(c.proc)}) did not start within "
                                   f"{start_timeout_s:.0f}s")
            started = c.conn.recv()
            if started.error:
                raise RuntimeError(f"engine replica {c.index} ({nodes.where(c.proc)}) failed to start: {started.error}")

    def _connect(self, senders: list[int]) -> None:
        """Every sending rank opens a group that every worker of every replica joins (collective)."""
        if self.senders == senders:
            return
        dead = collectives.share([c.index for c in self.clients if not c.proc.is_alive()] if self.leader else None)
        if dead:
            raise EngineDied(f"engine replicas {dead} are not running")
        tp, replicas = self._args["tp"], self._args["replicas"]
        world = 1 + replicas * tp
        mine = _sender_socket(self.rank in senders, elsewhere=self._dedicated)
        groups = [address for address in collectives.gather(mine and mine[:2]) if address is not None]
        self.sender, errors = None, []
        try:
            for c in self.clients:
                c.call(InitTransfer({"groups": groups, "world_size": world, "rank_offset": 1 + c.index * tp,
                                     "backend": self.transport, "timeout_s": self.timeout_s}), reply=False)
            if self.rank in senders:
                host, port, sock = mine
                group = join_group(host, port, 0, world, self.transport, self.timeout_s, listen_socket=sock)
                self.sender = GlooSender(group, wire_device(self.transport))
            errors = [f"replica {c.index}: {r.error}" for c in self.clients if (r := self._reply(c)).error]
        except Exception as exc:  # noqa: BLE001  (every rank raises below)
            errors.append(f"trainer rank {self.rank}: {type(exc).__name__}: {exc}")
        errors = [e for part in collectives.gather(errors) for e in part]
        if errors:
            self.sender = None
            raise EngineDied(f"engine replicas could not join the weight transfer groups: {'; '.join(errors)}")
        self.senders = senders

    def _reply(self, c: ReplicaClient, timeout_s: float | None = None):
        """Wait for replica ``c``'s reply, polling that it (and every other replica) is still alive."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        try:
            while not c.conn.poll(0.2):
                if why := self.dead():
                    raise EngineDied(why)
                if time.monotonic() > deadline:
                    raise EngineDied(f"engine replica {c.index} did not answer within {self.timeout_s:.0f}s")
            return c.conn.recv()
        except (EOFError, OSError) as exc:  # the pipe or link ended (a killed link is closed here)
            raise EngineDied(f"engine replica {c.index} ({nodes.where(c.proc)}) died") from exc

    def slot_engines(self) -> list[SlotEngine]:
        return list(self.clients)  # (rank 0's; none on the other trainer ranks)

    def served_versions(self) -> list[int]:
        return list(self.versions)

    def generate(self, requests: list[GenerationRequest], seed: int, replica: int = 0) -> list[list[Completion]]:
        """Batch generation (evaluation, the audit) on one replica (0 unless asked); every trainer rank gets it."""
        out = None
        if self.leader:
            try:
                out = Generated(self.clients[replica].call(Generate(requests, seed)))
            except EngineUnusable as exc:
                out = Generated(error=str(exc), unusable=True)
            except Exception as exc:  # noqa: BLE001  (every rank raises it, none waits for an answer)
                out = Generated(error=f"{type(exc).__name__}: {exc}")
        out = collectives.share(out)
        if out.unusable:
            raise EngineUnusable(out.error)
        if out.error:
            raise EngineDied(f"generation on engine replica {replica} failed: {out.error}")
        return out.completions

    def load(self, stream: StreamingSync | AdapterStream, version: int, in_flight: bool = False) -> LoadReport:
        """Refused while requests run, unless the load is ``in_flight`` (they go on under the new weights); then
        each bucket from the trainer rank that sends it (``StreamingSync.sends``), or with LoRA the adapters."""
        if not in_flight:
            busy = collectives.share([c.index for c in self.clients if c.num_active()] if self.leader else None)
            if busy:
                raise SyncError(f"weight sync refused: replicas {busy} still have requests in flight; end the phase "
                                "first")
        if isinstance(stream, AdapterStream):
            return self.load_adapters(stream, version, in_flight)
        buckets, sources = stream.sends()
        return self.update(stream.piece_plan(), buckets, version, stream.dtype, sources, in_flight=in_flight)

    def load_adapters(self, stream: AdapterStream, version: int, in_flight: bool = False) -> LoadReport:
        """LoRA: the trainer's adapters (gathered on every rank: ``AdapterStream.tensors``) sent by rank 0 to every
        replica over its link (no weight group: they are ~1-5% of the weights), each replica switching to them on
        all of its TP workers or on none (``process.load_adapter``); the same outcome on every trainer rank."""
        tensors = stream.tensors()
        start, verdict = time.perf_counter(), None
        if self.leader:
            try:
                msg = LoadAdapter(packed(tensors), stream.config, version, in_flight)
            except Exception as exc:  # noqa: BLE001  (nothing sent: every rank raises below, none waits)
                verdict = Verdict([f"trainer rank 0: {type(exc).__name__}: {exc}"], list(self.versions))
            else:
                died = ""
                try:
                    for c in self.clients:
                        c.call(msg, reply=False)
                except EngineDied as exc:
                    died = str(exc)
                verdict = self._collect(died)
        verdict = collectives.share(verdict)
        self._settle(verdict, verdict.failed, f"LoRA adapter update to version {version}")
        return LoadReport(transfer_s=time.perf_counter() - start, replica_update_s=verdict.slowest_update_s,
                          replica_load_s=verdict.slowest_load_s,
                          sent_bytes=float(stream.stats.bytes * len(self.versions)))

    def sleep(self) -> None:
        pass  # replicas have devices of their own: nothing to hand over

    def wake(self) -> None:
        pass

    def update(self, plan: list, buckets, version: int, dtype: torch.dtype = torch.float32,
               sources: list[int] | None = None, stage_only: bool = False, in_flight: bool = False) -> LoadReport:
        """Broadcast ``buckets`` (this rank's flat tensors, in ``plan`` order; bucket i comes from trainer rank
        ``sources[i]``, all 0 if None) to every replica; all-or-nothing per replica, and the same outcome on
        every trainer rank. ``stage_only`` (the bench's transfer-only figure): the replicas receive the buckets
        and cut them into their named views but load nothing and keep their weights and version."""
        sources = [0] * len(plan) if sources is None else list(sources)
        senders = sorted(set(sources))
        sizes = [sum(math.prod(shape) for _, shape in pieces) for pieces in plan]
        try:
            self._connect(senders)
        except EngineDied as exc:
            self._end_all()
            raise WeightLoadError(f"weight update to version {version} failed ({exc}); every replica was ended: "
                                  "the next phase restarts them") from exc
        start, error, sent = time.perf_counter(), None, 0
        watch = DeathWatch(self) if self.leader else None  # a replica that dies mid-broadcast ends them all
        try:
            groups = [senders.index(s) for s in sources]
            for c in self.clients:  # (rank 0 only; a replica already gone: the watchdog ends the others)
                c.call(Update(plan, groups, str(dtype).removeprefix("torch."), version, self.rollback, stage_only,
                              in_flight), reply=False)
            # the fill (gathers, re-layout, cast) asks for no CUDA device: without the trainer's cuda→cpu mode
            # its torch calls cost ~25% less (measured), as in the colocated load (``protocol.load``)
            with cpu_suspended():
                if self.sender is not None:
                    sent = self.sender.send(buckets, [n for n, s in zip(sizes, sources) if s == self.rank], dtype)
                else:
                    for _ in buckets:  # a TP peer of a sender: it helps gather (the bucket is not its own)
                        pass
        except Exception as exc:  # noqa: BLE001  (the sender told the replicas to abort; reported below)
            error = f"trainer rank {self.rank}: {type(exc).__name__}: {exc}"
            try:  # a broken link: finish the walk, so that this rank's TP peers' all-gathers find it there
                for _ in buckets:
                    pass
            except Exception:  # noqa: BLE001  (the stream itself failed: nothing more to walk)
                pass
        seconds = time.perf_counter() - start
        verdict = self._collect(watch.stop()) if self.leader else None
        parts = collectives.gather((error, verdict, sent))
        verdict = parts[0][1]
        self.sent_by_rank = [n for _, _, n in parts]
        self._settle(verdict, [e for e, _, _ in parts if e is not None] + verdict.failed,
                     f"weight update to version {version}")
        return LoadReport(backup_mib=verdict.backup_mib, transfer_s=seconds, replica_update_s=verdict.slowest_update_s,
                          replica_load_s=verdict.slowest_load_s, sent_bytes=float(sum(n for _, _, n in parts)))

    def _settle(self, verdict: Verdict, errors: list[str], what: str) -> None:
        """Every trainer rank, after an update or an adapter load (``what``): the versions the replicas serve, the
        transfer groups dropped if a replica died, and ``WeightLoadError`` if anything failed."""
        self.versions = verdict.versions
        if verdict.died:
            self.senders, self.sender = None, None
        if errors:
            ended = "; every replica was ended: the next phase restarts them" if verdict.died else ""
            raise WeightLoadError(f"{what} failed ({'; '.join(errors)}); replicas serve versions {verdict.versions}"
                                  f"{ended}")

    def _collect(self, died: str = "") -> Verdict:
        """Rank 0: every replica's reply to an update; each replica's phases of it (seconds, CPU, page faults) in
        ``last_phases``. A dead replica ends them all."""
        v = Verdict([], [])
        self.last_phases = []
        try:
            if died:
                raise EngineDied(died)
            for c in self.clients:
                u = self._reply(c)
                c.weight_version = u.version
                if u.error:
                    v.failed.append(f"replica {c.index}: {u.error}")
                else:
                    v.backup_mib, v.slowest_update_s = max(v.backup_mib, u.backup_mib), max(v.slowest_update_s,
                                                                                           u.seconds)
                    v.slowest_load_s = max(v.slowest_load_s, u.phases.get("load_s", 0.0))
                    self.last_phases.append(u.phases)
        except EngineDied as exc:
            self._end_all()  # their transfer group is broken: a live replica may wait on it forever
            v = Verdict([str(exc)], [], died=True)
        v.versions = [c.weight_version for c in self.clients]
        return v

    def _end_all(self) -> None:
        for c in self.clients:
            if c.proc.is_alive():
                _kill(c.proc)
            c.proc.join(10)
        reaper.unlink_orphans()  # the rings the killed replicas' engines could not unlink

    def dead(self) -> str:
        """'' while every replica process runs, else which one died."""
        for c in self.clients:
            if not c.proc.is_alive():
                return f"engine replica {c.index} ({nodes.where(c.proc)}) died (exit code {c.proc.exitcode})"
        return ""

    def broadcast_raw(self, buckets: list[torch.Tensor]) -> float:
        """The transport alone: the same buckets broadcast to every replica, received and dropped; seconds."""
        plan = [[("raw", (b.numel(),))] for b in buckets]
        self._connect([0])
        for c in self.clients:
            c.call(RecvRaw(plan, [0] * len(plan), str(buckets[0].dtype).removeprefix("torch.")), reply=False)
        start = time.perf_counter()
        self.sender.send(iter(buckets), [b.numel() for b in buckets], buckets[0].dtype)
        for c in self.clients:
            self._reply(c)
        return time.perf_counter() - start

    def close(self, hosts: bool = True) -> None:
        """End the replicas (and, unless ``hosts`` is False, the links to the engine nodes' hosts)."""
        for c in self.clients:
            if c.proc.is_alive():
                try:
                    c.conn.send(Close())
                    if c.conn.poll(10):
                        c.conn.recv()
                except (BrokenPipeError, EOFError, OSError):
                    pass
                c.proc.join(10)
            if c.proc.is_alive() or isinstance(c.proc, nodes.RemoteProcess):  # (a link: closed either way)
                _kill(c.proc)
                c.proc.join(5)
        for proc in self._local:  # another node's leader: its own replica processes (told to close by rank 0)
            proc.join(10)
            if proc.is_alive():
                _kill(proc)
                proc.join(5)
        self._local = []
        reaper.unlink_orphans()  # a killed (or crashed) replica's engine leaves its rings behind
        if hosts and self._pool is not None:  # every host kills its replicas and exits 0
            self._pool.close()
            self._pool = None


def _sender_socket(sends: bool, elsewhere: bool = False):
    """This rank's transfer group's (host, port) and listening socket if it ``sends``, else None (collective):
    loopback when the whole run is on one host (not when the replicas run ``elsewhere``, on engine-only nodes)."""
    hosts = collectives.gather(socket.gethostname())
    if not sends:
        return None
    host = nodes.reachable_host(hosts, elsewhere)
    sock = listen(host)
    return host, sock.getsockname()[1], sock


def _kill(proc) -> None:
    """End a replica: a local process with its vLLM workers (``reaper.kill_tree``), a link by closing it."""
    if isinstance(proc, nodes.RemoteProcess):
        proc.kill()
    elif proc.is_alive():
        reaper.kill_tree(proc.pid)
