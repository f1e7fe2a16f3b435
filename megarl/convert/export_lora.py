"""A LoRA run's export: its adapters as a PEFT adapter directory, loadable over the base model by ``peft``
(``PeftModel.from_pretrained``) and vLLM, and merged into the base by ``tools/merge_lora.py``.

``<run_dir>/hf/step_<N>/`` then holds ``adapter_config.json`` (``trainer/lora_peft.py``'s ``peft_config``, its
``base_model_name_or_path`` the absolute path of the base the engines served: ``convert.lora_base.engine_model_dir``),
``adapter_model.safetensors`` (the adapters under PEFT's names, in the full export's dtype; routed experts' in
PEFT's fused layout, ``models/peft_experts.py``) and the base's tokenizer
files — not its ``config.json``, generation config or weights. Written to ``step_<N>.tmp`` and renamed, as the full
export is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megarl.convert.hf_files import copy_aux_files, publish, staging_dir
from megarl.models.hf_config import model_files_dir
from megarl.models.peft_experts import fuse_experts
from megarl.trainer.lora_peft import gather_adapters, peft_config, peft_tensors

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
BASE_ONLY = ("config.json", "generation_config.json")
"""Files of the base the adapter directory leaves out (``copy_aux_files`` copies them beside full weights)."""


def export_adapter(trainer, model_dir: str | Path, out: str | Path, dtype: torch.dtype) -> Path | None:
    """Write the trainer's adapters (``trainer.lora``: their config) as a PEFT adapter directory at ``out`` (every
    rank calls: the adapters are gathered whole on every rank; rank 0 writes). Returns ``out`` on rank 0, None
    elsewhere."""
    adapters = gather_adapters(trainer.modules, trainer.ps, trainer.hf_cfg)  # collective
    if dist.is_initialized() and dist.get_rank() != 0:
        dist.barrier()
        return None
    out, base = Path(out), model_files_dir(model_dir).resolve()
    tmp = staging_dir(out)
    tensors = fuse_experts(peft_tensors(adapters, trainer.hf_cfg, dtype))  # (experts: PEFT's target_parameters)
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config(trainer.lora, str(base)), indent=2) + "\n")
    for name in copy_aux_files(base, tmp):  # the tokenizer and chat template; the base's config stays the base's
        if name in BASE_ONLY:
            (tmp / name).unlink()
    publish(tmp, out)
    if dist.is_initialized():
        dist.barrier()
    return out
