"""Reading an HF ``config.json``: the supported families and what the trainer needs to know of one.

Plain Python (no torch), so config validation can use it before any process starts.
"""

from __future__ import annotations

import json
from pathlib import Path

# Families whose HF names the adapter maps (megarl/models/hf_adapter.py).
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "llama", "mistral", "mixtral")


DTYPE_NAMES = ("bfloat16", "float16", "float32")
"""The weight dtypes megarl exports and syncs, by the names HF configs and the sync's messages use."""


def torch_dtype(name: str):
    """The torch dtype named ``name``, one of ``DTYPE_NAMES`` (KeyError naming the valid ones otherwise)."""
    if name not in DTYPE_NAMES:
        raise KeyError(f"weight dtype {name!r}: valid {', '.join(DTYPE_NAMES)}")
    import torch

    return getattr(torch, name)


def is_dist_checkpoint(model_path: str | Path) -> bool:
    """``model_path`` is a megatron dist checkpoint (``tools/convert_checkpoint.py hf-to-mcore``'s output), not an
    HF directory: its weights load through megatron's dist checkpointing, its config and tokenizer are in ``hf/``."""
    path = Path(model_path)
    return (path / "metadata.json").is_file() and not (path / "config.json").is_file()


def model_files_dir(model_path: str | Path) -> Path:
    """Where ``model_path``'s config, tokenizer and chat template are: the HF directory itself, or a converted dist
    checkpoint's ``hf/`` (which ``hf-to-mcore`` writes beside the weights)."""
    path = Path(model_path)
    return path / "hf" if is_dist_checkpoint(path) else path


def read_hf_config(model_dir: str | Path, key: str = "model.path") -> dict:
    """The HF ``config.json`` of ``model_dir`` (given as ``key``: 'model.path', '--hf', ...; a converted dist
    checkpoint's ``hf/config.json``), checked for what megarl supports."""
    path = model_files_dir(model_dir) / "config.json"
    if not path.is_file():
        where = (f"{path.parent} (a megatron dist checkpoint keeps its HF config there, as tools/convert_checkpoint.py "
                 "hf-to-mcore writes it)" if is_dist_checkpoint(model_dir) else str(model_dir))
        raise FileNotFoundError(f"{key}: no config.json in {where}")
    cfg = json.loads(path.read_text())
    if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{path}: model_type {cfg.get('model_type')!r} is not supported; valid: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    check_model_math(cfg, str(path))
    return cfg


_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.gguf")


def missing_safetensors(model_dir: str | Path) -> str:
    """Why ``model_dir`` has no weights megarl reads ('' when it has ``*.safetensors``): the trainer and
    the converters read safetensors only, though vLLM would load a ``pytorch_model.bin``; the message
    names the weight files found and how to re-save them (one place for every reader's error)."""
    path = Path(model_dir)
    if any(path.glob("*.safetensors")):
        return ""
    found = sorted(f.name for pattern in _OTHER_WEIGHTS for f in path.glob(pattern))
    what = (f"it holds {', '.join(found[:4])}{' ...' if len(found) > 4 else ''}, a format megarl does not read"
            if found else "it holds no weight files")
    return (f"no *.safetensors files in model directory {path}: {what}; megarl reads safetensors only. "
            "Re-save the model with transformers, which writes safetensors: python -c \"from transformers import "
            f"AutoModelForCausalLM as M; M.from_pretrained('{path}', dtype='auto').save_pretrained('{path}')\"")


def check_weights_format(model_dir: str | Path) -> None:
    """FileNotFoundError (``missing_safetensors``' message) unless ``model_dir`` holds ``*.safetensors``."""
    problem = missing_safetensors(model_dir)
    if problem:
        raise FileNotFoundError(f"model.path: {problem}")


def num_experts(cfg: dict) -> int:
    """Routed experts per MoE layer (0 for dense)."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def has_qkv_bias(cfg: dict) -> bool:
    """Bias on the q/k/v projections: built into the Qwen2 families."""
    return cfg.get("model_type") in ("qwen2", "qwen2_moe")


def has_qk_norm(cfg: dict) -> bool:
    """RMS norms on q and k per head: built into the Qwen3 families."""
    return cfg.get("model_type") in ("qwen3", "qwen3_moe")


def is_moe_layer(cfg: dict, layer: int) -> bool:
    """Whether global layer ``layer`` has routed experts (Qwen-MoE's ``mlp_only_layers`` and
    ``decoder_sparse_step`` make some layers dense; Mixtral's are all sparse)."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    return num_experts(cfg) > 0 and layer not in (cfg.get("mlp_only_layers") or []) and (layer + 1) % step == 0


# transformers' own defaults for math keys a config.json may leave out, where they differ by family (the
# fallbacks below hold for every other supported family); tests/unit/test_tiny_and_adapter.py compares with
# transformers.
_FAMILY_DEFAULTS = {"mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6}}


def _family_default(cfg: dict, key: str, fallback: float) -> float:
    return _FAMILY_DEFAULTS.get(cfg.get("model_type"), {}).get(key, fallback)


def rms_norm_eps(cfg: dict) -> float:
    eps = cfg.get("rms_norm_eps")
    return float(eps if eps is not None else _family_default(cfg, "rms_norm_eps", 1e-6))


def norm_topk_prob(cfg: dict) -> bool:
    """Whether the router's top-k weights are renormalised to sum to 1: Mixtral's always are (softmax over the
    top-k logits); Qwen-MoE's as ``norm_topk_prob`` says, False when left out (transformers' default)."""
    return True if cfg.get("model_type") == "mixtral" else bool(cfg.get("norm_topk_prob", False))


def rope_theta(cfg: dict) -> float:
    return rope_parameters(cfg)["rope_theta"]


# RoPE variants the trainer reproduces exactly (transformers' and vLLM's meaning), and why others are refused.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_ROPE_REFUSED = {
    "dynamic": "dynamic NTK rescales only past max_position_embeddings in transformers but always in vLLM, "
               "so the trainer and the engine would disagree",
}


def rope_parameters(cfg: dict) -> dict:
    """The RoPE parameters of an HF config as transformers standardises them: ``rope_type``,
    ``rope_theta`` and the scaling keys, from ``rope_parameters`` (transformers ≥ 5) or the older
    ``rope_scaling`` (``type`` or ``rope_type``) + ``rope_theta``."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    params["rope_theta"] = float(params.get("rope_theta") or cfg.get("rope_theta")
                                 or _family_default(cfg, "rope_theta", 10000.0))
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings") or cfg.get("max_position_embeddings"))
    return params


def check_model_math(cfg: dict, where: str = "config.json") -> None:
    """Refuse, before anything is built, config keys that change the model's math in a way the
    trainer does not reproduce (a silent mismatch with transformers and vLLM otherwise)."""
    rope_type = rope_parameters(cfg)["rope_type"]
    if rope_type not in ROPE_TYPES:
        why = _ROPE_REFUSED.get(rope_type, "the trainer has no implementation of it")
        raise ValueError(f"{where}: rope_scaling.rope_type {rope_type!r} is not supported ({why}); "
                         f"supported: {', '.join(ROPE_TYPES)}")
    if float(cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
             or 1.0) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor {cfg.get('partial_rotary_factor')} is not supported; "
                         "supported: 1.0 (RoPE over the whole head)")
    refused = {
        "attention_bias": "bias on q/k/v/o projections (Qwen2's q/k/v bias is built in)",
        "mlp_bias": "bias on the MLP projections",
        "use_qk_norm": "Llama-4 style q/k norm",
    }
    for key, what in refused.items():
        if cfg.get(key):
            raise ValueError(f"{where}: {key}=true ({what}) is not supported by the trainer; supported: false")
    if cfg.get("qk_layernorm") and not has_qk_norm(cfg):
        raise ValueError(f"{where}: qk_layernorm=true on {cfg.get('model_type')} is not supported; "
                         "q/k norms are supported as Qwen3 and Qwen3-MoE define them")
    act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported; supported: 'silu'")


def sliding_window(cfg: dict) -> int | None:
    """The attention window of an HF config, or None when attention is full (Qwen2/3 only use
    ``sliding_window`` with ``use_sliding_window``; Mistral and Mixtral whenever it is set)."""
    window = cfg.get("sliding_window")
    if cfg.get("model_type") in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window"):
        return None
    return int(window) if window else None


def check_sequence_length(cfg: dict, seq_len: int, where: str = "config.json") -> None:
    """Refuse sequences longer than the model's sliding attention window (the trainer attends fully)."""
    window = sliding_window(cfg)
    if window is not None and window < seq_len:
        raise ValueError(f"{where}: sliding_window={window} is smaller than the sequence length {seq_len} "
                         f"(engine.max_model_len); the trainer attends over the whole sequence, so keep "
                         f"engine.max_model_len <= {window}")
