"""The HF adapter of the Qwen/Llama/Mistral families: Megatron-core names and layouts ⇄ HF names.

One map, shared by the offline conversion tools and the online weight sync. It
works on *full* (unsharded) tensors with *global* layer and expert indices;
``shard_for_rank`` / the trainer's gather turn those into one rank's pieces.
``hf_parts`` names the HF tensors one Megatron tensor is made of, from the same
maps, for the trainer's load, which reads only its slices of them (``hf_slices.py``).

Layouts (Megatron-core local spec, ``GPTModel``):

===============================================  =================================================
Megatron                                          HF
===============================================  =================================================
embedding.word_embeddings.weight                  model.embed_tokens.weight
decoder.layers.L.input_layernorm.weight           model.layers.L.input_layernorm.weight
decoder.layers.L.self_attention.linear_qkv.*      q_proj / k_proj / v_proj (``*`` weight or bias),
                                                  interleaved per query group: for each of the
                                                  ``kv`` groups, [its heads/kv q heads, k, v]
decoder.layers.L.self_attention.q_layernorm       self_attn.q_norm (Qwen3)
decoder.layers.L.self_attention.linear_proj       self_attn.o_proj
decoder.layers.L.pre_mlp_layernorm.weight         post_attention_layernorm.weight
decoder.layers.L.mlp.linear_fc1.weight            cat(mlp.gate_proj, mlp.up_proj) (dense)
decoder.layers.L.mlp.linear_fc2.weight            mlp.down_proj
decoder.layers.L.mlp.router.weight                mlp.gate.weight (MoE)
...mlp.experts.local_experts.E.linear_fc1/fc2     mlp.experts.E.{gate_proj,up_proj}/down_proj
decoder.layers.L.mlp.shared_experts.linear_fc1/2  mlp.shared_expert.{gate_proj,up_proj}/down_proj
decoder.layers.L.mlp.shared_experts.gate_weight   mlp.shared_expert_gate.weight (Qwen2-MoE)
decoder.final_layernorm.weight                    model.norm.weight
output_layer.weight                               lm_head.weight
===============================================  =================================================

Mixtral names its MoE block ``block_sparse_moe`` and its experts' projections ``w1`` (gate),
``w3`` (up), ``w2`` (down); those names are renamed to the Qwen-MoE ones on the way in and
back on the way out, so the table above serves both.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from megarl.models.sharding import LAYER_NAME

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

# Per-layer names that map one to one.
_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
# Gated MLPs: Megatron's fused linear_fc1 = cat(gate_proj, up_proj) under this HF prefix.
_FC1 = {"mlp.linear_fc1.weight": "mlp.", "mlp.shared_experts.linear_fc1.weight": "mlp.shared_expert."}
_FC1_BACK = {f"{hf}{proj}.weight": fc1 for fc1, hf in _FC1.items() for proj in ("gate_proj", "up_proj")}
_SIMPLE_BACK = {v: k for k, v in _SIMPLE.items()}
# Transformer Engine's spec fuses these norms into the following linear (export direction only).
_SIMPLE["self_attention.linear_qkv.layer_norm_weight"] = "input_layernorm.weight"
_SIMPLE["mlp.linear_fc1.layer_norm_weight"] = "post_attention_layernorm.weight"
_GLOBAL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_GLOBAL_BACK = {v: k for k, v in _GLOBAL.items()}


# Mixtral's MoE block: block_sparse_moe.{gate, experts.E.w1|w3|w2} ⇄ mlp.{gate, experts.E.*_proj}.
def _moe_block_renamer(src: str, dst: str, projs: dict[str, str]):
    """``.src.gate.weight`` / ``.src.experts.E.<p>.weight`` → the same under ``dst`` with ``projs[p]``."""
    pattern = re.compile(rf"\.{src}\.(gate|experts\.\d+\.({'|'.join(projs)}))\.weight$")

    def sub(m: re.Match) -> str:
        body, proj = m.groups()
        return f".{dst}.{body if proj is None else body[: -len(proj)] + projs[proj]}.weight"

    return lambda name: pattern.sub(sub, name)


_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_from_mixtral = _moe_block_renamer("block_sparse_moe", "mlp", _MIXTRAL_PROJ)
_to_mixtral = _moe_block_renamer("mlp", "block_sparse_moe", {v: k for k, v in _MIXTRAL_PROJ.items()})


def head_layout(cfg: dict) -> tuple[int, int, int]:
    """(query heads, kv heads, head dim) of an HF config."""
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    return heads, kv, cfg.get("head_dim") or cfg["hidden_size"] // heads


def qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Interleave HF q/k/v (weights [out, in] or biases [out]) into Megatron's per-group layout."""
    heads, kv, d = head_layout(cfg)
    rest = q.shape[1:]
    q = q.reshape(kv, heads // kv * d, *rest)
    k = k.reshape(kv, d, *rest)
    v = v.reshape(kv, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def qkv_from_megatron(qkv: torch.Tensor, cfg: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``qkv_to_megatron``."""
    heads, kv, d = head_layout(cfg)
    rest = qkv.shape[1:]
    grouped = qkv.reshape(kv, (heads // kv + 2) * d, *rest)
    q, k, v = torch.split(grouped, [heads // kv * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def megatron_to_hf(named: Iterable[tuple[str, torch.Tensor]], cfg: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Full Megatron tensors (global layer / expert indices) → HF (name, tensor) pairs.

    Tied embeddings (``tie_word_embeddings``): the output layer (the last pipeline stage's copy of
    the embedding) is not exported; HF and vLLM keep the one embedding tensor."""
    if cfg.get("tie_word_embeddings"):
        named = ((name, t) for name, t in named if name != "output_layer.weight")
    pairs = _megatron_to_qwen_names(named, cfg)
    if cfg.get("model_type") == "mixtral":
        return ((_to_mixtral(name), t) for name, t in pairs)
    return pairs


def hf_parts(name: str, cfg: dict) -> tuple[str, tuple[str, ...]]:
    """The HF tensors the Megatron tensor ``name`` (global layer / expert indices) is made of, and how:
    ``('one', (n,))``; ``('qkv', (q, k, v))``, interleaved per query group (``qkv_to_megatron``); ``('fc1', (gate,
    up))``, stacked. Names as the checkpoint spells them (Mixtral's included); a tied model's output layer is the
    embedding. KeyError for a name that has no HF source (the loader's per-rank slice reader asks this)."""
    if name == "output_layer.weight" and cfg.get("tie_word_embeddings"):
        name = "embedding.word_embeddings.weight"
    kind, parts = _qwen_parts(name)
    if cfg.get("model_type") == "mixtral":
        parts = tuple(_to_mixtral(p) for p in parts)
    return kind, parts


def _qwen_parts(name: str) -> tuple[str, tuple[str, ...]]:
    if name in _GLOBAL:
        return "one", (_GLOBAL[name],)
    m = LAYER_NAME.match(name)
    if m is None:
        raise KeyError(f"no HF name for Megatron parameter {name!r}")
    layer, rest = m.groups()
    p = f"model.layers.{layer}."
    e = _EXPERT.match(rest)
    if rest in _SIMPLE:
        return "one", (p + _SIMPLE[rest],)
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]  # weight | bias
        return "qkv", tuple(f"{p}self_attn.{n}_proj.{kind}" for n in "qkv")
    if rest in _FC1:
        return "fc1", (p + _FC1[rest] + "gate_proj.weight", p + _FC1[rest] + "up_proj.weight")
    if e is not None:
        expert, fc = e.groups()
        q = f"{p}mlp.experts.{expert}."
        if fc == "linear_fc2":
            return "one", (q + "down_proj.weight",)
        return "fc1", (q + "gate_proj.weight", q + "up_proj.weight")
    raise KeyError(f"no HF name for Megatron parameter {name!r}")


def _megatron_to_qwen_names(named: Iterable[tuple[str, torch.Tensor]], cfg: dict) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in named:
        kind, parts = _qwen_parts(name)
        if kind == "qkv":
            yield from zip(parts, qkv_from_megatron(t, cfg))
        elif kind == "fc1":
            yield from zip(parts, torch.chunk(t, 2, dim=0))
        else:
            yield parts[0], t


def hf_to_megatron(hf: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """An HF state dict → full Megatron tensors with global layer / expert indices."""
    if cfg.get("model_type") == "mixtral":
        hf = {_from_mixtral(name): t for name, t in hf.items()}
    if cfg.get("tie_word_embeddings"):  # a tied checkpoint's lm_head, where present, is the embedding
        hf = {name: t for name, t in hf.items() if name != "lm_head.weight"}
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if name in _GLOBAL_BACK:
            out[_GLOBAL_BACK[name]] = t
            continue
        m = _HF_LAYER.match(name)
        if m is None:
            raise KeyError(f"no Megatron name for HF tensor {name!r}")
        layer, rest = m.groups()
        if rest in _SIMPLE_BACK:
            out[f"decoder.layers.{layer}.{_SIMPLE_BACK[rest]}"] = t
        else:
            pending[name] = t  # fused below, once all of its parts are known
    for name in list(pending):
        if name not in pending:
            continue
        layer, rest = _HF_LAYER.match(name).groups()
        p, mp = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        e = _HF_EXPERT.match(rest)
        if rest.startswith("self_attn.") and rest.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
            kind = rest.rsplit(".", 1)[1]
            q, k, v = (pending.pop(f"{p}self_attn.{n}_proj.{kind}") for n in "qkv")
            out[f"{mp}self_attention.linear_qkv.{kind}"] = qkv_to_megatron(q, k, v, cfg)
        elif rest in _FC1_BACK:
            hp = p + _FC1[_FC1_BACK[rest]]
            gate, up = pending.pop(hp + "gate_proj.weight"), pending.pop(hp + "up_proj.weight")
            out[mp + _FC1_BACK[rest]] = torch.cat([gate, up], dim=0)
        elif e is not None:
            expert, proj = e.groups()
            q, mq = f"{p}mlp.experts.{expert}.", f"{mp}mlp.experts.local_experts.{expert}."
            if proj == "down_proj":
                out[mq + "linear_fc2.weight"] = pending.pop(name)
            else:
                gate, up = pending.pop(q + "gate_proj.weight"), pending.pop(q + "up_proj.weight")
                out[mq + "linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        else:
            raise KeyError(f"no Megatron name for HF tensor {name!r}")
    return out
