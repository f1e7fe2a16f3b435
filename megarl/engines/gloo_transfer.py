"""Our weight-transfer backend for vLLM's RL API, on gloo: trainer → every engine worker, one broadcast per bucket.

vLLM 0.32's ``LLM.init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` drive a worker-side ``WeightTransferEngine`` chosen by
``weight_transfer_config={"backend": ...}``; its built-in backends are GPU-only. Importing this
module (vLLM imports it as the ``worker_extension_cls`` module, in every worker) registers
``megarl_gloo``:

- ``init_transfer_engine``: join a bare gloo group (``stateless_init_torch_distributed_process_group``)
  of the trainer's sending rank (rank 0) and every worker of every replica (ranks 1..).
- ``start_weight_update``: back up the model (``weight_update.snapshot``), begin vLLM's layerwise reload.
- ``receive_weights``: per bucket of the plan (names + shapes, sent once in ``update_info``), a
  one-element flag broadcast (1: a bucket follows; 0: the trainer aborted) then the bucket
  itself, whose HF views go to ``model.load_weights``. Any failure — the trainer's abort, a
  dead link, a bad tensor — finishes vLLM's layerwise state and restores the backup, so the
  replica keeps serving the old weights; the error is re-raised to the caller.
- ``finish_weight_update``: finalize the reload, repack fused-MoE layers, drop the backup.

The same wire format is spoken by ``GlooSender`` on the trainer side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from megarl.engines.weight_update import repack_moe, restore, snapshot

BACKEND = "megarl_gloo"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def join_group(host: str, port: int, rank: int, world_size: int):
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(host, port, rank, world_size, backend="gloo")


def _broadcast(tensor: torch.Tensor, group) -> None:
    """From rank 0 of a bare (stateless) group: such a group is unknown to ``torch.distributed``'s helpers."""
    group.broadcast(tensor, 0).wait()


def _post(group, numel: int, dtype: torch.dtype):
    """Start receiving the next (flag, bucket) pair; returns them with their pending works."""
    flag, bucket = torch.zeros(1, dtype=torch.int64), torch.empty(numel, dtype=dtype)
    return flag, bucket, (group.broadcast(flag, 0), group.broadcast(bucket, 0))


class TransferAborted(RuntimeError):
    """The trainer aborted the update mid-way."""


def _register() -> None:
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    @dataclass
    class GlooInitInfo(WeightTransferInitInfo):
        host: str = "127.0.0.1"
        port: int = 0
        world_size: int = 2
        rank_offset: int = 1  # this replica's first rank in the group (its worker of TP rank r is offset + r)

    @dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        buckets: list = field(default_factory=list)  # [[(hf name, shape), …], …] in send order
        dtype: str = "float32"

    class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        supports_draft_weight_update = False

        group = None
        backup = None

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            rank = init_info.rank_offset + self.parallel_config.rank
            self.group = join_group(init_info.host, init_info.port, rank, init_info.world_size)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self.backup = snapshot(self.model)
            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            dtype, plan = _DTYPES[update_info.dtype], update_info.buckets
            sizes = [sum(math.prod(s) for _, s in pieces) for pieces in plan]
            incoming = _post(self.group, sizes[0], dtype) if sizes else None
            failure = None
            for i, pieces in enumerate(plan):
                flag, bucket, works = incoming
                for w in works:
                    w.wait()
                if int(flag) != 1:
                    failure = failure or TransferAborted("the trainer aborted the weight update")
                    break
                # the next bucket arrives while this one loads (gloo runs its transfers on its own threads)
                incoming = _post(self.group, sizes[i + 1], dtype) if i + 1 < len(sizes) else None
                if failure is not None:
                    continue  # a local failure: keep receiving so the trainer and the other replicas go on
                try:
                    views, offset = [], 0
                    for name, shape in pieces:
                        n = math.prod(shape)
                        views.append((name, bucket[offset:offset + n].view(tuple(shape))))
                        offset += n
                    with torch.no_grad():
                        self.model.load_weights(iter(views))
                except Exception as exc:  # noqa: BLE001  (restored below, re-raised to the caller)
                    failure = exc
            if failure is not None:
                try:
                    finalize_layerwise_reload(self.model, self.model_config)
                except Exception:  # noqa: BLE001  (already failing: the restore is what matters)
                    pass
                restore(self.backup)
                self.backup = None
                raise failure

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            repack_moe(self.model)
            self.backup = None

        def shutdown(self) -> None:
            self.group = None

    WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)


class GlooWorkerExtension:
    """The ``worker_extension_cls`` of our engine replicas: importing its module registers the backend."""

    def megarl_recv_raw(self, sizes: list[int], dtype: str = "float32") -> int:
        """Receive buckets of ``sizes`` elements in our wire format and drop them (the bench's transport baseline)."""
        group, flag, got = self.weight_transfer_engine.group, torch.zeros(1, dtype=torch.int64), 0
        for n in sizes:
            _broadcast(flag, group)
            bucket = torch.empty(n, dtype=_DTYPES[dtype])
            _broadcast(bucket, group)
            got += bucket.nbytes
        return got

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
    """The trainer's side: broadcast each bucket once to every replica's workers (rank 0 of the group).

    One bucket is on the wire while the next is filled; an abort sends the flag 0 with a bucket
    of the size the receivers expect next, so every posted receive completes."""

    def __init__(self, group) -> None:
        self.group = group

    def send(self, buckets, sizes: list[int], dtype: torch.dtype = torch.float32) -> int:
        """``buckets``: an iterator of flat tensors of ``sizes`` elements, in plan order; returns the bytes sent.

        If the iterator raises, the receivers are told to abort and the error is re-raised."""
        sent, posted, pending = 0, 0, ()
        one = torch.ones(1, dtype=torch.int64)
        try:
            for bucket in buckets:
                works = (self.group.broadcast(one, 0), self.group.broadcast(bucket, 0))
                for w in pending:
                    w.wait()
                pending, _held = works, bucket  # keep the bucket alive until it is on the wire
                posted, sent = posted + 1, sent + bucket.nbytes
        except BaseException:
            for w in pending:
                w.wait()
            if posted < len(sizes):
                _broadcast(torch.zeros(1, dtype=torch.int64), self.group)
                _broadcast(torch.zeros(sizes[posted], dtype=dtype), self.group)
            raise
        for w in pending:
            w.wait()
        return sent
