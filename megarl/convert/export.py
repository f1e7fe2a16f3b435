"""The policy as an HF checkpoint, ready for transformers, vLLM or a new run's ``model.path``.

``export_policy`` writes ``<run_dir>/hf/step_<N>/`` every ``train.export_hf_every`` steps and at
the end of a run: the trainer's weights streamed as HF tensors (the engine sync's own stream,
bucket by bucket; no rank holds the whole model), written tensor by tensor into safetensors shards with an index
(``ShardedWriter``), in the dtype of the model the run started from (``config.json``'s ``torch_dtype`` / ``dtype``),
next to that model's config, generation config and tokenizer files. Written to ``step_<N>.tmp`` and
renamed, so a directory named ``step_<N>`` is always complete.

A LoRA run (the trainer has adapters, ``lora.rank`` > 0) exports its adapters instead, as a PEFT adapter directory
over the base model (``export_lora.py``); ``tools/merge_lora.py`` merges one into the base as a full checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.convert.export_lora import export_adapter
from megarl.convert.hf_files import ShardedWriter, copy_aux_files, publish, staging_dir
from megarl.convert.lora_base import engine_model_dir
from megarl.models.hf_config import DTYPE_NAMES, model_files_dir, num_experts, torch_dtype
from megarl.weight_sync.streaming import StreamingSync

log = logging.getLogger(__name__)


def export_dtype(hf_cfg: dict) -> torch.dtype:
    """The dtype the HF model was published in (float32 when the config does not say)."""
    name = str(hf_cfg.get("dtype") or hf_cfg.get("torch_dtype") or "float32")
    return torch_dtype(name) if name in DTYPE_NAMES else torch.float32


def export_hf(trainer, model_dir: str | Path, out: str | Path, max_shard_bytes: int = 5 * 2**30,
              bucket_mib: float = 64.0) -> Path | None:
    """Write the trainer's policy as an HF checkpoint at ``out`` (every rank calls; rank 0 writes); a trainer with
    LoRA adapters, its adapters as a PEFT adapter directory (``export_lora.export_adapter``).

    The weights leave the trainer through the engine sync's stream (``StreamingSync``: layer by
    layer, in buckets, each tensor gathered only over its own TP group), so no rank holds the
    whole model: rank 0 writes each bucket's tensors at their planned offsets as they arrive."""
    out = Path(out)
    if getattr(trainer, "adapters", None):
        return export_adapter(trainer, model_dir, out, export_dtype(trainer.hf_cfg))
    stream = StreamingSync(trainer.modules, trainer.hf_cfg, trainer.ps, num_experts(trainer.hf_cfg),
                           int(bucket_mib * 2**20), export_dtype(trainer.hf_cfg))
    plan = [(name, shape, stream.dtype) for e in stream.plan() for name, shape in e.hf]  # collective
    if dist.is_initialized() and dist.get_rank() != 0:
        for _ in stream.weights():  # collective: the buckets' senders and broadcasts
            pass
        dist.barrier()
        return None
    writer = ShardedWriter(out, plan, max_shard_bytes)
    tmp = writer.out = staging_dir(out)
    for name, tensor in stream.weights():
        writer.add(name, tensor)
    writer.finish()
    copy_aux_files(model_files_dir(model_dir), tmp)  # (a dist checkpoint's: its hf/)
    publish(tmp, out)
    if dist.is_initialized():
        dist.barrier()
    return out


def export_policy(s, step: int, final: bool = False) -> Path | None:
    """``train.export_hf_every`` / end of run: the policy to ``<run_dir>/hf/step_<step>`` (a LoRA run's: its adapters,
    as a PEFT adapter directory)."""
    every = s.cfg.train.export_hf_every
    due = bool(every) and step % every == 0
    if (final and due and step > 0) or (not final and not due):  # (final: the loop just exported it)
        return None
    path = export_hf(s.trainer, engine_model_dir(s.cfg), Path(s.run_dir) / "hf" / f"step_{step}",
                     max_shard_bytes=int(s.cfg.train.export_shard_gib * 2**30))
    if path is not None:
        adapter = bool(getattr(s.trainer, "adapters", None))
        what = "a PEFT adapter (tools/merge_lora.py merges it)" if adapter else "an HF checkpoint"
        log.info(f"exported the policy as {what}: {path}")
    return path
