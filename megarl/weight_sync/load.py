"""The engine side of a weight sync: an all-or-nothing load into a vLLM model, and the served version.

``load_or_restore`` loads an iterator of HF-named tensors into the model with vLLM's in-place
reload (``initialize_layerwise_reload`` → ``model.load_weights`` → ``finalize_layerwise_reload``,
with the fused-MoE experts processed inside it and the tied LM head repacked after, as vLLM 0.32 needs:
``compat.vllm.experts_processed_in_reloads``, ``repack_after_reload``). vLLM processes each layer as soon as all of its
tensors have arrived and copies the result back into the layer's original tensors, so a stream
that breaks half-way would leave the model a mix of two versions. Before loading we therefore
copy every parameter and buffer of the model (in its processed, kernel form) to host memory; on
any exception we let vLLM finish its layerwise state (no layer stays on the meta device), copy
the old tensors back, and re-raise. The engine then serves exactly the
old weights.

Cost: one copy of the engine's weights in host memory for the duration of a sync (the model's
size in the engine's dtype; on a GPU engine this is host RAM, not device memory), plus one
device-to-host copy of the weights per sync (a memcpy: ~0.05 s for the 193 MB tiny model here).

``sync.rollback: resync`` opts out of that copy: nothing is backed up, and a load that fails
mid-way leaves the model a mix, so the engine marks itself unusable (its version becomes
``UNUSABLE``, and generating on it raises ``EngineUnusable``) until a later sync loads it
completely; the loop's engine-error path (the keeper: restart or recover, then a full sync) does
that at the next phase. Never a mix served, at no extra host memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

import torch

from megarl.compat.vllm import experts_processed_in_reloads, repack_after_reload

UNUSABLE = -1
"""The weight version of an engine whose load failed with no backup: it serves no version."""


class WeightLoadError(RuntimeError):
    """A sync failed mid-way; the engine was restored to the weights it had before (``sync.rollback: copy``)
    or is unusable until it is re-synced (``sync.rollback: resync``)."""


class SyncError(RuntimeError):
    """A sync that could not start (e.g. requests still in flight); nothing was changed."""


class EngineUnusable(RuntimeError):
    """Generation refused: the engine's last load failed with no backup (``sync.rollback: resync``)."""


def unusable_message(why: str) -> str:
    return (f"weight load failed mid-way ({why}); sync.rollback=resync took no backup, so the engine holds a mix "
            "of two versions and is unusable until it is re-synced (the next phase restarts it and syncs the "
            "whole model)")


@dataclass
class LoadReport:
    """What one load into the engines did (``Engines.load``); ``metrics`` names each figure as the logs do."""

    backup_mib: float = 0.0
    """The host copy kept to restore from (``sync.rollback: copy``; the largest over replicas)."""
    transfer_s: float | None = None
    """Replicas: this rank's broadcast of its buckets, wall seconds (LoRA: rank 0's send of the adapters and the
    replicas' loads of them; the other ranks' wait)."""
    replica_update_s: float | None = None
    """Replicas: the slowest replica's whole update (receive, load, finish), seconds."""
    replica_load_s: float | None = None
    """Replicas: the slowest replica's time inside vLLM's load, seconds."""
    sent_bytes: float | None = None
    """Replicas: the bytes every trainer rank sent together."""

    def metrics(self) -> dict[str, float]:
        return {f"sync/{f.name}": float(v) for f in fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass
class Backup:
    """Each module's attributes as they were (references) plus copies of the tensors vLLM overwrites in place."""

    attrs: dict  # module → shallow copy of its __dict__ (with its own _parameters/_buffers dicts)
    copies: dict  # (module, kind, name) → host copy of that tensor's values

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.copies.values())


def _module_tensors(module: torch.nn.Module):
    for name, t in module._parameters.items():
        if t is not None:
            yield "_parameters", name, t
    for name, t in module._buffers.items():
        if t is not None:
            yield "_buffers", name, t
    for name, t in vars(module).items():
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and "kv_cache" not in name:
            yield "", name, t


@torch.no_grad()
def snapshot(model: torch.nn.Module) -> Backup:
    """Every module's state: attributes by reference, tensors' values by copy.

    vLLM's CPU backend keeps the packed linear weights inside a ``cpu_linear`` closure and
    replaces the closure when a layer is processed again, so holding the old closure keeps the
    old packed weights intact at no copy; processed values that vLLM copies back into a layer's
    original tensors are saved as host copies. The KV cache (a reload never touches it) is not.
    """
    attrs, copies = {}, {}
    for m in model.modules():
        d = dict(vars(m))
        d["_parameters"], d["_buffers"] = dict(m._parameters), dict(m._buffers)
        attrs[m] = d
        for kind, name, t in _module_tensors(m):
            if not t.is_meta and t.numel():
                copies[(m, kind, name)] = t.detach().to("cpu", copy=True)
    return Backup(attrs, copies)


@torch.no_grad()
def restore(backup: Backup) -> None:
    for m, d in backup.attrs.items():
        vars(m).clear()
        vars(m).update(d)
    for (m, kind, name), old in backup.copies.items():
        t = (vars(m)[kind] if kind else vars(m))[name]
        if t.shape != old.shape:
            raise RuntimeError(f"cannot restore {type(m).__name__}.{name}: shape {tuple(t.shape)} != "
                               f"{tuple(old.shape)}")
        t.copy_(old)


def load_or_restore(model: torch.nn.Module, model_config, weights: Iterable[tuple[str, torch.Tensor]],
                    agree: Callable[[bool], bool] | None = None, rollback: str = "copy") -> int:
    """Load ``weights`` into ``model`` completely, or leave it exactly as it was; returns the backup's bytes.

    ``agree(ok)`` (engine ranks of one model): True only if every rank loaded; a rank that
    loaded while another failed restores too, so no rank serves a version the others do not.
    ``rollback="resync"``: no backup (0 bytes); a failure raises ``WeightLoadError`` with the model
    left a mix, on every rank of the model: the caller marks the engine unusable."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    experts_processed_in_reloads()
    saved = snapshot(model) if rollback == "copy" else None
    error: BaseException | None = None
    try:
        with torch.no_grad():
            initialize_layerwise_reload(model)
            model.load_weights(iter(weights))
            finalize_layerwise_reload(model, model_config)
            repack_after_reload(model)
    except Exception as exc:  # noqa: BLE001  (restored below and re-raised as WeightLoadError)
        error = exc
        try:
            finalize_layerwise_reload(model, model_config)  # put every layer back on real storage
        except Exception:  # noqa: BLE001  (already failing: the restore below is what matters)
            pass
    everyone = agree(error is None) if agree is not None else error is None
    if error is None and everyone:
        return saved.nbytes if saved is not None else 0
    why = f"{type(error).__name__}: {error}" if error is not None else "another engine rank failed to load"
    if saved is None:
        raise WeightLoadError(unusable_message(why)) from error
    restore(saved)
    raise WeightLoadError(f"weight load failed mid-way ({why}); the engine was restored to its previous weights") \
        from error
