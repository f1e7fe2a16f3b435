"""Our weight-transfer backend for vLLM's RL API: trainer sending ranks → every engine worker, one broadcast per bucket.

vLLM 0.32's ``LLM.init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` drive a worker-side ``WeightTransferEngine`` chosen by
``weight_transfer_config={"backend": ...}``. Importing this module (vLLM imports it as the
``worker_extension_cls`` module, in every worker) registers ``megarl_gloo``, which speaks over
gloo (CPU) or NCCL (GPU, ``sync.transport: nccl``: the same wire format on CUDA tensors):

- ``init_transfer_engine``: join one bare group per trainer *sending rank*
  (``stateless_init_torch_distributed_process_group``): the sender is rank 0 of its group,
  every worker of every replica joins every group (ranks 1..). A trainer at TP=2 has one
  sender (the TP leader gathers each tensor); at PP=2 or EP=2 each stage / expert rank sends
  its own layers over its own group, and nobody gathers the rest.
- ``start_weight_update``: back up the model (``weight_update.snapshot``; not with ``sync.rollback:
  resync``, set per update by ``megarl_set_rollback``), begin vLLM's layerwise reload.
- ``receive_weights``: per bucket of the plan (names + shapes + the sender's group, sent once in
  ``update_info``), a one-element flag broadcast (1: a bucket follows; 0: that sender aborted
  and sends nothing more) then the bucket itself, whose HF views go to ``model.load_weights``.
  The next bucket is received while the current one loads. A failure — a sender's abort, a
  dead link, a bad tensor — does not raise out of the worker (vLLM's multiprocess executor would
  leave the other TP workers' replies queued for the next call): each worker keeps it
  (``megarl_update_outcome``), and if any worker of a replica failed, every one of them finishes
  vLLM's layerwise state and restores its backup (``megarl_abandon_update``), so the replica
  keeps serving the old weights on all of its workers, never a mix (with no backup the replica
  marks itself unusable instead: ``replica_process``).
- ``finish_weight_update``: finalize the reload, repack fused-MoE layers, drop the backup.

The same wire format is spoken by ``GlooSender`` on the trainer side. A group's timeout
(``sync.timeout_s``) bounds every wait: a trainer that dies mid-update cannot hang a replica forever.
"""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from megarl.compat.torch import gloo_group_bound_to
from megarl.compat.vllm import repack_after_reload
from megarl.engines.remote.nodes import local_address_to
from megarl.engines.weight_update import restore, snapshot
from megarl.models.hf_config import torch_dtype

BACKEND = "megarl_gloo"


def listen(host: str = "127.0.0.1") -> socket.socket:
    """The bound, listening socket a group's rank 0 (a trainer sender) serves the group's store on."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen()
    return sock


def join_group(host: str, port: int, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 0.0,
               listen_socket: socket.socket | None = None):
    """A bare process group (unknown to ``torch.distributed``'s helpers): ``gloo`` or ``nccl``.

    Rank 0 passes its ``listen`` socket: it then serves the store itself even inside a torchrun
    job (whose ``TORCHELASTIC_USE_AGENT_STORE`` would otherwise make it a client of nobody)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    timeout = timedelta(seconds=timeout_s) if timeout_s > 0 else None
    if backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME"):  # (the user's interface choice wins)
        return gloo_group_bound_to(host if listen_socket is not None else local_address_to(host), host, port, rank,
                                  world_size, timeout, listen_socket)
    return stateless_init_torch_distributed_process_group(host, port, rank, world_size, backend=backend,
                                                          timeout=timeout, listen_socket=listen_socket)


def _post(group, numel: int, dtype: torch.dtype, device):
    """Start receiving the next (flag, bucket) pair of ``group``; returns them with their pending works."""
    flag, bucket = torch.zeros(1, dtype=torch.int64, device=device), torch.empty(numel, dtype=dtype, device=device)
    return flag, bucket, (group.broadcast(flag, 0), group.broadcast(bucket, 0))


class TransferAborted(RuntimeError):
    """A trainer sending rank aborted the update mid-way."""


def receive(groups: list, plan: list, sources: list[int], dtype: torch.dtype, device, load,
            timings: dict | None = None) -> int:
    """Receive every bucket of ``plan`` (bucket i from ``groups[sources[i]]``); ``load(i, views)`` each one.

    The next bucket is on the wire while ``load`` runs. A failure (a sender's abort, ``load``
    raising) is raised at the end, after every bucket the live senders send was received, so
    the senders and the other replicas go on. Returns the bytes received."""
    sizes = [sum(math.prod(s) for _, s in pieces) for pieces in plan]
    aborted: set[int] = set()
    failure, got = None, 0

    def post_from(i: int):
        while i < len(plan) and sources[i] in aborted:
            i += 1  # that sender sends nothing more
        return (i, _post(groups[sources[i]], sizes[i], dtype, device)) if i < len(plan) else (i, None)

    clock = time.perf_counter
    times = {"wait_s": 0.0, "load_s": 0.0} if timings is None else timings
    i, incoming = post_from(0)
    while incoming is not None:
        flag, bucket, works = incoming
        t = clock()
        for w in works:
            w.wait()
        times["wait_s"] = times.get("wait_s", 0.0) + clock() - t
        if int(flag) != 1:
            aborted.add(sources[i])
            failure = failure or TransferAborted(f"trainer sender {sources[i]} aborted the weight update")
            i, incoming = post_from(i + 1)
            continue
        got += bucket.nbytes
        current, (i, incoming) = i, post_from(i + 1)  # the next bucket arrives while this one loads
        if failure is not None:
            continue  # a local failure: keep receiving so the senders and the other replicas go on
        try:
            views, offset = [], 0
            for name, shape in plan[current]:
                n = math.prod(shape)
                views.append((name, bucket[offset:offset + n].view(tuple(shape))))
                offset += n
            t = clock()
            load(current, views)
            times["load_s"] = times.get("load_s", 0.0) + clock() - t
        except Exception as exc:  # noqa: BLE001  (raised below, after the stream ends)
            failure = exc
    if failure is not None:
        raise failure
    return got


def _register() -> None:
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    @dataclass
    class GlooInitInfo(WeightTransferInitInfo):
        groups: list = field(default_factory=list)  # [(host, port)] of each trainer sending rank's group
        world_size: int = 2  # of each group: 1 sender + every worker of every replica
        rank_offset: int = 1  # this replica's first rank in each group (its worker of TP rank r is offset + r)
        backend: str = "gloo"  # or "nccl" (CUDA tensors)
        timeout_s: float = 0.0  # every wait of the group (0: torch's default)

    @dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        buckets: list = field(default_factory=list)  # [[(hf name, shape), …], …] in send order
        sources: list = field(default_factory=list)  # each bucket's group (index into ``groups``)
        dtype: str = "float32"

    class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        supports_draft_weight_update = False

        groups: list = []
        device = torch.device("cpu")
        backup = None
        rollback = "copy"  # sync.rollback: 'copy' backs up before each update, 'resync' does not
        failure = ""  # why the last receive failed on this worker
        timings: dict = {}  # the last update's phases on this worker, seconds

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            rank = init_info.rank_offset + self.parallel_config.rank
            if init_info.backend == "nccl":
                self.device = torch.device("cuda", torch.cuda.current_device())
            self.groups = [join_group(host, port, rank, init_info.world_size, init_info.backend, init_info.timeout_s)
                           for host, port in init_info.groups]

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            start = time.perf_counter()
            self.backup = snapshot(self.model) if self.rollback == "copy" else None
            self.timings = {"snapshot_s": time.perf_counter() - start}
            initialize_layerwise_reload(self.model)
            self.timings["start_s"] = time.perf_counter() - start

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            def load(_, views):
                with torch.no_grad():
                    self.model.load_weights(iter(views))

            plan = update_info.buckets
            sources = update_info.sources or [0] * len(plan)
            self.failure = ""
            try:
                receive(self.groups, plan, sources, torch_dtype(update_info.dtype), self.device, load, self.timings)
            except Exception as exc:  # noqa: BLE001  (kept for ``outcome``; the replica restores every worker)
                self.failure = f"{type(exc).__name__}: {exc}"

        def outcome(self) -> str:
            """'' when this worker received and loaded every bucket, else why not."""
            return self.failure

        def abandon(self) -> None:
            """Put this worker's previous weights back (every worker of a replica does, if any failed); with
            no backup (``rollback='resync'``) only end vLLM's layerwise state: the replica is then unusable."""
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            try:
                finalize_layerwise_reload(self.model, self.model_config)  # no layer stays on the meta device
            except Exception:  # noqa: BLE001  (already failing: the restore is what matters)
                pass
            if self.backup is not None:
                restore(self.backup)
            self.backup, self.failure = None, ""

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            start = time.perf_counter()
            finalize_layerwise_reload(self.model, self.model_config)
            repack_after_reload(self.model)
            self.backup = None
            self.timings["finish_s"] = time.perf_counter() - start

        def shutdown(self) -> None:
            self.groups = []

    WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)


class GlooWorkerExtension:
    """The ``worker_extension_cls`` of our engine replicas: importing its module registers the backend."""

    def megarl_recv_raw(self, plan: list, sources: list[int], dtype: str = "float32") -> int:
        """Receive buckets in our wire format and drop them (the bench's transport baseline); bytes received."""
        engine = self.weight_transfer_engine
        return receive(engine.groups, plan, sources, torch_dtype(dtype), engine.device, lambda i, views: None)

    def megarl_set_rollback(self, mode: str) -> None:
        """``sync.rollback`` for the next updates: 'copy' (back up first) or 'resync' (no backup)."""
        self.weight_transfer_engine.rollback = mode

    def megarl_recv_staged(self, plan: list, sources: list[int], dtype: str = "float32") -> dict:
        """An update's transfer without vLLM's load: every bucket received and cut into its HF-named views,
        which are then dropped (the bench's transfer-only figure); the phases, as ``megarl_update_timings``."""
        engine, timings = self.weight_transfer_engine, {}
        receive(engine.groups, plan, sources, torch_dtype(dtype), engine.device, lambda i, views: None, timings)
        return timings

    def megarl_update_outcome(self) -> str:
        return self.weight_transfer_engine.outcome()

    def megarl_abandon_update(self) -> None:
        """Restore this worker and end vLLM's update session as ``finish_weight_update`` would, loading nothing."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self.weight_transfer_engine.abandon()
        self.weight_transfer_engine.reset_weight_update_target()
        self._weight_update_active = False

    def megarl_update_timings(self) -> dict:
        """The last update's phases on this worker (seconds): snapshot, start, wait (receive), load, finish."""
        return dict(self.weight_transfer_engine.timings)

    def megarl_backup_mib(self) -> float:
        engine = getattr(self, "weight_transfer_engine", None)
        backup = getattr(engine, "backup", None)
        return backup.nbytes / 2**20 if backup is not None else 0.0


try:
    _register()
except ImportError:  # vLLM absent: the trainer-side sender below still imports
    pass
except ValueError:  # already registered (module imported twice)
    pass


class GlooSender:
    """A trainer sending rank's side: broadcast each of its buckets once to every replica's workers (rank 0 of its group).

    One bucket is on the wire while the next is filled; an abort sends the flag 0 with a bucket
    of the size the receivers expect next (so every posted receive completes) and then nothing."""

    def __init__(self, group, device=None) -> None:
        self.group, self.device = group, torch.device("cpu") if device is None else device

    def send(self, buckets, sizes: list[int], dtype: torch.dtype = torch.float32) -> int:
        """``buckets``: an iterator of this sender's flat tensors of ``sizes`` elements, in plan order; bytes sent.

        If the iterator or the link raises, the receivers are told to abort and the error is re-raised."""
        sent, posted, pending = 0, 0, ()
        one = torch.ones(1, dtype=torch.int64, device=self.device)
        try:
            for bucket in buckets:
                works = (self.group.broadcast(one, 0), self.group.broadcast(bucket, 0))
                for w in pending:
                    w.wait()
                pending, _held = works, bucket  # keep the bucket alive until it is on the wire
                posted, sent = posted + 1, sent + bucket.nbytes
            for w in pending:
                w.wait()
        except BaseException:
            try:
                for w in pending:
                    w.wait()
                if posted < len(sizes):
                    zero = torch.zeros(1, dtype=torch.int64, device=self.device)
                    self.group.broadcast(zero, 0).wait()
                    self.group.broadcast(torch.zeros(sizes[posted], dtype=dtype, device=self.device), 0).wait()
            except Exception:  # noqa: BLE001  (the link itself is broken: the caller ends the replicas)
                pass
            raise
        return sent
