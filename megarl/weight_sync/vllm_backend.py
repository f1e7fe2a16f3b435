"""Our weight-transfer backend for vLLM's RL API (``megarl_gloo``), in every worker of an engine replica.

vLLM 0.32's ``LLM.init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` drive a worker-side ``WeightTransferEngine`` chosen by
``weight_transfer_config={"backend": ...}``. Importing this module (vLLM imports it as the
``worker_extension_cls`` module, in every worker) registers ``megarl_gloo``, which receives the
``transport`` wire format over gloo (CPU) or NCCL (GPU, ``sync.transport: nccl``):

- ``init_transfer_engine``: join every trainer sending rank's group (``transport.join_group``).
- ``start_weight_update``: back up the model (``load.snapshot``; not with ``sync.rollback: resync``, set per
  update by ``megarl_set_rollback``), begin vLLM's layerwise reload.
- ``receive_weights``: every bucket (``transport.receive``), whose HF views go to ``model.load_weights``. A
  failure — a sender's abort, a dead link, a bad tensor — does not raise out of the worker (vLLM's multiprocess
  executor would leave the other TP workers' replies queued for the next call): each worker keeps it
  (``megarl_update_outcome``), and if any worker of a replica failed, every one of them finishes vLLM's layerwise
  state and restores its backup (``megarl_abandon_update``), so the replica keeps serving the old weights on all of
  its workers, never a mix (with no backup the replica marks itself unusable instead: ``engines.remote.process``).
- ``finish_weight_update``: finalize the reload, repack fused-MoE layers, drop the backup.

With LoRA (``lora.rank`` > 0) no weights move: each worker registers the trainer's adapters from memory
(``megarl_add_adapter``) and the replica switches to them once every worker has (``engines.remote.process``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from megarl.compat.vllm import (
    experts_processed_in_reloads,
    lora_patches,
    repack_after_reload,
)
from megarl.models.hf_config import torch_dtype
from megarl.weight_sync.adapter_load import register, unpacked
from megarl.weight_sync.load import restore, snapshot
from megarl.weight_sync.transport import join_group, receive, wire_device

BACKEND = "megarl_gloo"
WORKER_EXTENSION = "megarl.weight_sync.vllm_backend.GlooWorkerExtension"
"""The ``worker_extension_cls`` an engine replica's ``LLM`` is started with: vLLM imports this module in every
worker."""


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
            # (vLLM set ``device`` to the worker's GPU; under gloo buckets arrive on the host, its loaders copy them in)
            self.device = wire_device(init_info.backend)
            self.groups = [join_group(host, port, rank, init_info.world_size, init_info.backend, init_info.timeout_s)
                           for host, port in init_info.groups]

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            experts_processed_in_reloads()
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

    def megarl_add_adapter(self, wire: dict, config: dict, adapter_id: int) -> str:
        """LoRA (``lora.rank`` > 0): the trainer's adapters (``adapter_load.packed``) registered as ``adapter_id``
        beside what this worker serves; '' when done, else why not (``adapter_load.register``)."""
        try:
            tensors = unpacked(wire)
        except Exception as exc:  # noqa: BLE001  (every worker's outcome is agreed on by the replica)
            return f"{type(exc).__name__}: {exc}"
        return register(self.model_runner.lora_manager, tensors, config, adapter_id,
                        self.model_config.hf_config.to_dict())

    def megarl_remove_adapter(self, adapter_id: int) -> None:
        """Adapter ``adapter_id`` dropped from this worker (served or only registered; absent: nothing)."""
        self.model_runner.lora_manager.remove_adapter(adapter_id)

    def megarl_backup_mib(self) -> float:
        engine = getattr(self, "weight_transfer_engine", None)
        backup = getattr(engine, "backup", None)
        return backup.nbytes / 2**20 if backup is not None else 0.0


try:
    _register()
except ImportError:  # vLLM absent (a trainer-only environment): nothing to register
    pass
except ValueError:  # already registered (module imported twice)
    pass
try:
    lora_patches()  # (every worker imports this module before it builds the model)
except (ImportError, RuntimeError):  # vLLM absent, or another version (refused where an engine starts)
    pass
