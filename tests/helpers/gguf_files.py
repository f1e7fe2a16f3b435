"""GGUF files written from transformers-built checkpoints the way llama.cpp's ``convert_hf_to_gguf.py`` lays them
out, with the ``gguf`` package's own writer: what a user downloads as "the GGUF of model X", at test size.

The conventions followed (llama.cpp's, not megarl's): tensor names from gguf's ``TensorNameMap``; every tensor
squeezed; Llama's q/k rows permuted to GGML's rotary layout; each layer's routed experts stacked into one
``ffn_{gate,up,down}_exps`` tensor [experts, rows, cols]; the expert (and shared expert) sizes as
``expert_feed_forward_length`` / ``expert_shared_feed_forward_length``; llama3 RoPE scaling as the per-frequency
divisors in ``rope_freqs.weight`` (no metadata key holds it); the tokenizer as a ``gpt2`` BPE vocabulary with its
merges and chat template. Tensors are stored as F32, so the file holds the checkpoint's exact numbers. (llama.cpp
computes ``rope_freqs`` with ``original_max_position_embeddings`` from the config's top level, 8192 when absent,
which is Llama 3's own value; this writer takes the model's value wherever its config has it, so that the file
describes the checkpoint's model at any test size.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from megarl.models.hf_config import num_experts

GGUF_ARCH = {"llama": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
"""HF ``model_type`` → the GGUF architecture llama.cpp writes for it (the ones these tests need)."""


def llama3_rope_divisors(rope: dict, head_dim: int) -> torch.Tensor:
    """llama.cpp's ``rope_freqs`` for llama3 scaling: by how much each rotary frequency is divided."""
    base = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope.get("original_max_position_embeddings", 8192)
    divisors = []
    for freq in base.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(divisors, dtype=torch.float32)


def _permute_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's q/k rows (rotary halves) → GGML's interleaved pairs, per head (llama.cpp's ``LlamaModel.permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(cfg: dict, weights: dict[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under GGUF names, in llama.cpp's layout."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    out, experts = {}, {}
    for hf_name, w in weights.items():
        parts = hf_name.split(".")
        if "experts" in parts:  # model.layers.L.mlp.experts.E.gate_proj.weight: stacked below
            experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = w
            continue
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            w = _permute_rotary(w, cfg["num_attention_heads"])
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            w = _permute_rotary(w, cfg["num_key_value_heads"])
        stem, suffix = hf_name.rsplit(".", 1)
        out[f"{names.get_name(stem)}.{suffix}"] = w
    for (layer, proj), by_expert in experts.items():
        stacked = torch.stack([by_expert[e] for e in sorted(by_expert)])
        out[f"{names.get_name(f'model.layers.{layer}.mlp.experts.{proj}')}.weight"] = stacked
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        out["rope_freqs.weight"] = llama3_rope_divisors(rope, head_dim)
    return {name: w.squeeze() for name, w in out.items()}


def _add_tokenizer(writer, tokenizer_json: dict, chat_template: str | None, pre: str) -> None:
    """The checkpoint's byte-level BPE as llama.cpp stores a ``gpt2`` tokenizer."""
    vocab = {**tokenizer_json["model"]["vocab"], **{t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}}
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {t["content"] for t in tokenizer_json["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])  # 3: CONTROL, 1: NORMAL
    writer.add_token_merges(merges)
    if chat_template:
        writer.add_chat_template(chat_template)


def write_gguf(hf_dir: str | Path, path: str | Path, pre: str = "qwen2", extra: dict[str, int | float] | None = None,
               replace: dict[str, torch.Tensor | None] | None = None) -> Path:
    """The GGUF of the HF checkpoint ``hf_dir`` (config.json, model.safetensors, tokenizer) at ``path``; ``extra``:
    more metadata keys ``{arch}.<key>`` (int or float); ``replace``: GGUF tensors written instead (None: left out)."""
    from gguf import GGUFWriter

    hf_dir, path, extra = Path(hf_dir), Path(path), dict(extra or {})
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["model_type"]]
    writer = GGUFWriter(str(path), arch)
    writer.add_name(hf_dir.name)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(extra.pop("feed_forward_length", cfg["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    if num_experts(cfg):
        writer.add_expert_count(num_experts(cfg))
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(extra.pop("expert_feed_forward_length", cfg["moe_intermediate_size"]))
        if cfg.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    for key, value in extra.items():
        (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(f"{arch}.{key}", value)
    template = hf_dir / "chat_template.jinja"
    _add_tokenizer(writer, json.loads((hf_dir / "tokenizer.json").read_text()),
                   template.read_text() if template.is_file() else None, pre)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    tensors = {**_tensors(cfg, load_file(str(hf_dir / "model.safetensors")), arch), **(replace or {})}
    for name, w in tensors.items():
        if w is None:
            continue
        writer.add_tensor(name, np.ascontiguousarray(w.to(torch.float32).numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
