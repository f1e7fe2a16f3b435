"""Tiny, real HF checkpoints built locally: config.json, safetensors weights, a tokenizer.

Four families, each deterministic by seed and never downloaded:

- ``qwen3_moe``: Qwen3-MoE style (q/k RMSNorm, routed experts, no biases);
- ``qwen2``: Qwen2 style dense (bias on q/k/v only);
- ``mixtral``: Mixtral style MoE (``block_sparse_moe.*`` names, experts ``w1``/``w3``/``w2``);
- ``qwen2_moe``: Qwen2-MoE style (a sigmoid-gated shared expert beside the routed ones,
  un-renormalised top-k, and a middle layer dense through ``mlp_only_layers``: MoE layers on both sides of it,
  so that a layer's MoE column differs from its layer index past it).

The tokenizer is a byte-level BPE trained here with ``tokenizers`` on a small fixed
corpus (chat turns, math in LaTeX, the addition scratchpad), with digits split one
by one (as Qwen's and Llama-3's do), Qwen's special tokens and a ChatML chat
template, wrapped as a ``PreTrainedTokenizerFast``: prompts take the same
``apply_chat_template`` path a hub tokenizer takes. Weights are drawn
from N(0, init_std) with a seeded generator and written under the exact tensor
names the hub checkpoints of these families use, so vLLM, transformers and our
Megatron adapter all read them as they would a real model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from megarl.data.addition import scratchpad
from megarl.models.hf_config import is_moe_layer, num_experts

FAMILIES = ("qwen3_moe", "qwen2", "mixtral", "qwen2_moe")
"""The families ``make_tiny_model`` builds (``model.make_tiny``)."""

PAD, IM_START, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen's ChatML: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per turn, then the assistant header."""


@dataclass(frozen=True)
class TinyShape:
    """The shape of a tiny model; defaults fit a small CPU machine (the demo and the tests)."""

    family: str = "qwen3_moe"
    vocab_size: int = 384
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    num_experts: int = 4
    experts_per_token: int = 2
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 192
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    init_std: float = 0.02


def _corpus() -> list[str]:
    """A fixed training corpus for the tiny BPE: chat turns (special tokens left out), LaTeX, scratchpads."""
    words = ("the answer is what compute simplify find value of sum product put final in and a to "
             "you are helpful assistant user system please step by think reason so therefore").split()
    latex = [rf"\boxed{{\frac{{{a}}}{{{b}}}}}" for a in range(1, 6) for b in range(2, 8)]
    latex += [rf"\sqrt{{{n}}}" for n in range(2, 9)] + [rf"\left({n}, {n + 3}\right]" for n in range(5)]
    latex += [r"\{1, 2\}", r"x^{2} + y^{2}", r"\pi", r"\cdot", r"\infty", "0.5", "-3"]
    turns = []
    for i, expr in enumerate(latex):
        q = " ".join(words[(i + k) % len(words)] for k in range(8))
        turns.append(f"system\nYou are a helpful assistant.\nuser\n{q}? "
                     f"Put the final answer in \\boxed{{}}.\nassistant\n{q} {expr}.\n")
    turns += [f"{a}+{b}:{scratchpad(a, b)}" for a, b in ((4073, 958), (15, 7), (999, 1))]
    return turns * 2


def build_tokenizer(vocab_size: int = 384):
    """A byte-level BPE of exactly ``vocab_size`` tokens, trained locally (no download), with ChatML.

    Ids 0-2 are ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (EOS); then the 256
    byte symbols and the merges learnt from ``_corpus()``; any ids left are reserved special
    tokens, so every id the model can sample decodes. Digits are pre-split one by one.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, IM_START, EOS]
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size {vocab_size} < {256 + len(specials)}: a byte-level BPE needs 256 byte "
                         f"symbols plus {len(specials)} special tokens")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(_corpus(), trainer)
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - core.get_vocab_size())]
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, model_max_length=4096,
                                  additional_special_tokens=[IM_START, *reserved])
    tok.chat_template = CHATML_TEMPLATE
    if len(tok) != vocab_size:
        raise AssertionError(f"tiny tokenizer has {len(tok)} tokens, expected {vocab_size}")
    return tok


def hf_config(shape: TinyShape, eos_id: int, pad_id: int) -> dict:
    """The config.json of the tiny model, as the hub would write it."""
    common = {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "rope_theta": shape.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    moe = {
        "num_experts_per_tok": shape.experts_per_token,
        "router_aux_loss_coef": 0.001,
    }
    qwen_moe = {
        **common, **moe,
        "intermediate_size": shape.intermediate_size,
        "moe_intermediate_size": shape.moe_intermediate_size,
        "num_experts": shape.num_experts,
        "decoder_sparse_step": 1,
    }
    if shape.family == "qwen3_moe":
        return {
            **qwen_moe,
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "head_dim": shape.head_dim,
            "norm_topk_prob": True,
            "mlp_only_layers": [],
            "attention_bias": False,
        }
    if shape.family == "qwen2_moe":
        return {
            **qwen_moe,
            "architectures": ["Qwen2MoeForCausalLM"],
            "model_type": "qwen2_moe",
            "shared_expert_intermediate_size": shape.shared_expert_intermediate_size,
            "norm_topk_prob": False,
            "mlp_only_layers": [shape.num_layers // 2],
        }
    if shape.family == "mixtral":
        return {
            **common, **moe,
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "head_dim": shape.head_dim,
            "intermediate_size": shape.moe_intermediate_size,
            "num_local_experts": shape.num_experts,
            "sliding_window": None,
        }
    if shape.family == "qwen2":
        return {
            **common,
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "intermediate_size": shape.intermediate_size,
        }
    raise ValueError(f"unknown tiny model family {shape.family!r}; valid: {', '.join(FAMILIES)}")


def hf_weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of an HF checkpoint of this config (the families above)."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    kind = cfg["model_type"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg["vocab_size"], h),
    }

    def mlp(prefix: str, ffn: int, names=("gate_proj", "up_proj", "down_proj")) -> None:
        gate, up, down = names
        shapes[f"{prefix}{gate}.weight"] = (ffn, h)
        shapes[f"{prefix}{up}.weight"] = (ffn, h)
        shapes[f"{prefix}{down}.weight"] = (h, ffn)

    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, heads * d)
        if kind in ("qwen2", "qwen2_moe"):
            shapes[p + "self_attn.q_proj.bias"] = (heads * d,)
            shapes[p + "self_attn.k_proj.bias"] = (kv * d,)
            shapes[p + "self_attn.v_proj.bias"] = (kv * d,)
        if kind == "qwen3_moe":
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if not is_moe_layer(cfg, i):
            mlp(p + "mlp.", cfg["intermediate_size"])
        elif kind == "mixtral":
            shapes[p + "block_sparse_moe.gate.weight"] = (num_experts(cfg), h)
            for e in range(num_experts(cfg)):
                mlp(f"{p}block_sparse_moe.experts.{e}.", cfg["intermediate_size"], ("w1", "w3", "w2"))
        else:
            shapes[p + "mlp.gate.weight"] = (num_experts(cfg), h)
            for e in range(num_experts(cfg)):
                mlp(f"{p}mlp.experts.{e}.", cfg["moe_intermediate_size"])
            if cfg.get("shared_expert_intermediate_size"):
                mlp(p + "mlp.shared_expert.", cfg["shared_expert_intermediate_size"])
                shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
    return shapes


def random_weights(cfg: dict, seed: int, init_std: float) -> dict[str, torch.Tensor]:
    """Seeded N(0, init_std) matrices, ones for norm weights, zeros for biases."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(hf_weight_shapes(cfg).items()):
        if name.endswith("norm.weight") or "layernorm" in name:
            out[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(shape)
        else:
            out[name] = torch.randn(shape, generator=gen) * init_std
    return out


def save_hf_checkpoint(path: str | Path, cfg: dict, weights: dict[str, torch.Tensor], tokenizer) -> Path:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen_cfg = {"eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"]}
    (path / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in weights.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(path))
    return path


def make_tiny_model(path: str | Path, shape: TinyShape = TinyShape(), seed: int = 0) -> Path:
    """Create a tiny HF checkpoint directory at ``path``; the same seed gives the same bytes."""
    tok = build_tokenizer(shape.vocab_size)
    cfg = hf_config(shape, eos_id=tok.convert_tokens_to_ids(EOS), pad_id=tok.pad_token_id)
    return save_hf_checkpoint(path, cfg, random_weights(cfg, seed, shape.init_std), tok)
