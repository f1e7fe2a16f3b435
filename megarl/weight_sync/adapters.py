"""The adapter-only weight sync (``lora.rank`` > 0): what streams to the engines is the trainer's LoRA adapters, not
its weights — every adapter gathered whole (``trainer.lora_peft``: over TP and the pipeline stages), named as PEFT
names them, cast to the engines' dtype, and served by each engine as a new adapter (``engines.adapters``). The base
weights the engines loaded at start never change, so a sync moves r · (in + out) numbers an adapted layer where the
full sync moves in · out (``sync/bytes``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from megarl.trainer.lora_peft import adapter_bytes, gather_adapters, peft_config, peft_tensors
from megarl.weight_sync.streaming import StreamingSync, SyncStats


@dataclass
class AdapterStream:
    """The trainer's adapters for the engines (``Engines.load`` takes it where it takes a ``StreamingSync``)."""

    trainer: object  # PolicyTrainer with adapters (``trainer.lora``: their LoraConfig)
    dtype: torch.dtype
    config: dict
    stats: SyncStats = field(default_factory=SyncStats)

    @classmethod
    def of(cls, trainer, dtype: torch.dtype) -> AdapterStream:
        return cls(trainer, dtype, peft_config(trainer.lora, trainer.model_dir))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every adapter, PEFT-named, in the engines' dtype (every trainer rank calls it: TP and PP exchanges)."""
        start = time.perf_counter()
        t = self.trainer
        out = peft_tensors(gather_adapters(t.modules, t.ps, t.hf_cfg), t.hf_cfg, self.dtype)
        size = adapter_bytes(out)
        self.stats = SyncStats(bytes=size, buckets=1, peak_extra_bytes=size, seconds=time.perf_counter() - start)
        return out


def stream_of(trainer, dtype: torch.dtype, bucket_mib: float):
    """What a sync of ``trainer`` streams: its adapters (``AdapterStream``) when it has any, else its weights."""
    if getattr(trainer, "adapters", None):
        return AdapterStream.of(trainer, dtype)
    return StreamingSync.of(trainer, dtype, bucket_mib)
