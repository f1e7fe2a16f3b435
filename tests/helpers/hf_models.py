"""Tiny checkpoints written by transformers itself (``from_config`` + ``save_pretrained``), as a
user's hub download would look: transformers' config.json (``rope_parameters``, ``layer_types``,
``sliding_window`` ...), its tensor names, tied weights left out, its generation_config.json;
plus megarl's character tokenizer so that vLLM can load the directory."""

from __future__ import annotations

from pathlib import Path

import torch

SMALL = dict(vocab_size=384, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, intermediate_size=192, max_position_embeddings=256, initializer_range=0.2,
             bos_token_id=1, eos_token_id=1, pad_token_id=0)
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           # small, so that scaling changes the frequencies that a 64-token sequence sees
           "original_max_position_embeddings": 32, "rope_theta": 10000.0}
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
SPECS = {
    # Llama-3.2 style: tied input/output embeddings and llama3 RoPE scaling
    "llama_tied_llama3": ("llama", dict(tie_word_embeddings=True, rope_parameters=_LLAMA3)),
    "qwen3": ("qwen3", dict(tie_word_embeddings=False)),
    "qwen3_tied": ("qwen3", dict(tie_word_embeddings=True)),
    "mistral": ("mistral", dict(tie_word_embeddings=False)),
    # Qwen2 / Qwen2.5 style: biases on q/k/v only, untied, plain RoPE
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),
    "llama_linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    "qwen2_yarn": ("qwen2", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                  "original_max_position_embeddings": 64})),
    "qwen3_moe": ("qwen3_moe", dict(_MOE, norm_topk_prob=True)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", dict(_MOE, shared_expert_intermediate_size=64, norm_topk_prob=False)),
    # dense layers beside MoE ones: checkpoint keys that only some layers have (checkpoint/layer_axis.py)
    "qwen2_moe_dense1": ("qwen2_moe", dict(_MOE, shared_expert_intermediate_size=64, norm_topk_prob=False,
                                           mlp_only_layers=[1])),
    "qwen2_moe_step2": ("qwen2_moe", dict(_MOE, shared_expert_intermediate_size=64, norm_topk_prob=False,
                                          decoder_sparse_step=2)),
}


def make_hf_model(path: str | Path, name: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                  max_shard_size: str | None = None, tokenizer: bool = True, **overrides) -> Path:
    """Write the tiny model ``name`` of ``SPECS`` with transformers into ``path`` (in shards with an
    index when ``max_shard_size`` is given, as hub checkpoints are); without a tokenizer where only the
    weights are read (``tokenizer=False``: a vocabulary too large to train one for)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.models.tiny import build_tokenizer

    model_type, extra = SPECS[name]
    cfg = AutoConfig.for_model(model_type, **{**SMALL, **extra, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():  # transformers initialises norms to one: make them non-trivial
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
    path = Path(path)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if tokenizer:
        build_tokenizer(cfg.vocab_size).save_pretrained(path)
    return path
