"""Reading an HF ``config.json``: the supported families and what the trainer needs to know of one.

Plain Python (no torch), so config validation can use it before any process starts.
"""

from __future__ import annotations

import json
from pathlib import Path

# Families whose HF names the adapter maps (megarl/weight_sync/hf_adapter.py).
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "llama", "mistral", "mixtral")


def read_hf_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model.path: no config.json in {model_dir}")
    cfg = json.loads(path.read_text())
    if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{path}: model_type {cfg.get('model_type')!r} is not supported; valid: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return cfg


def num_experts(cfg: dict) -> int:
    """Routed experts per MoE layer (0 for dense)."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def is_moe_layer(cfg: dict, layer: int) -> bool:
    """Whether global layer ``layer`` has routed experts (Qwen-MoE's ``mlp_only_layers`` and
    ``decoder_sparse_step`` make some layers dense; Mixtral's are all sparse)."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    return num_experts(cfg) > 0 and layer not in (cfg.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def rope_theta(cfg: dict) -> float:
    return float((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0)
