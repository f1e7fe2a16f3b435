"""Parameter counts of an HF config alone (no weights), by where a layout shards them.

Embedding (+ the output head unless tied), per layer attention (q, k, v, o with Qwen2's qkv biases, Qwen3's q/k
norms) and two norms, and either a dense SwiGLU MLP (3·h·f) or an MoE block: router (h·E), E routed experts
(3·h·f_e each, ``topk`` of them active), a shared expert and its gate (Qwen2-MoE). ``mlp_only_layers`` /
``decoder_sparse_step`` make layers dense.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.validate.lora import lora_targets
from megarl.models.hf_config import has_qk_norm, has_qkv_bias, is_moe_layer, num_experts


@dataclass(frozen=True)
class Counts:
    """Parameters of a model by where they are sharded."""

    embedding: int
    head: int
    attention: int
    """All layers' attention blocks and layer norms (+ the final norm)."""
    dense: int
    """Dense MLPs, routers, shared experts and their gates (split by TP)."""
    experts: int
    """Routed experts of all layers (split by EP × ETP)."""
    experts_active: int
    """Routed experts a token passes through (topk per MoE layer)."""

    @property
    def total(self) -> int:
        return self.embedding + self.head + self.attention + self.dense + self.experts

    @property
    def active(self) -> int:
        return self.total - self.experts + self.experts_active

    @property
    def in_layers(self) -> int:
        """Parameters of the layers a token passes through: the active ones less the embedding and output head."""
        return self.attention + self.dense + self.experts_active


def head_dim(hf: dict) -> int:
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def moe_layers(hf: dict) -> int:
    """How many layers hold routed experts (0: a dense model)."""
    if not num_experts(hf):
        return 0
    return sum(is_moe_layer(hf, i) for i in range(hf["num_hidden_layers"]))


def count_params(hf: dict) -> Counts:
    h, layers = hf["hidden_size"], hf["num_hidden_layers"]
    q, kv = hf["num_attention_heads"] * head_dim(hf), hf["num_key_value_heads"] * head_dim(hf)
    attn = 2 * h * q + 2 * h * kv + 2 * h  # q, o; k, v; two norms
    if has_qkv_bias(hf):
        attn += q + 2 * kv
    if has_qk_norm(hf):
        attn += 2 * head_dim(hf)  # q_norm, k_norm
    experts, topk = num_experts(hf), int(hf.get("num_experts_per_tok") or 0)
    f_expert = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
    f_shared = int(hf.get("shared_expert_intermediate_size") or 0)
    dense = routed = active = 0
    for layer in range(layers):
        if is_moe_layer(hf, layer):
            dense += h * experts + (3 * h * f_shared + h if f_shared else 0)
            routed += experts * 3 * h * f_expert
            active += topk * 3 * h * f_expert
        else:
            dense += 3 * h * hf["intermediate_size"]
    embedding = hf["vocab_size"] * h
    head = 0 if hf.get("tie_word_embeddings") else embedding
    return Counts(embedding, head, attn * layers + h, dense, routed, active)


def adapter_params(hf: dict, cfg, tp: int = 1, ep: int = 1, etp: int = 1) -> float:
    """LoRA's parameters (``cfg.lora``: rank r, targets) one TP rank of ``tp`` (and EP rank of ``ep``, expert-TP
    rank of ``etp``) holds over all layers: each adapted layer's A [r, in] and B [out, r], the one split over TP as
    its base layer is (column-parallel: B; row-parallel: A), the other whole; 0 without LoRA. Dense MLP targets
    only in the layers without routed experts; ``experts``: every routed expert's fc1 and fc2, split over expert TP
    as a dense MLP's over TP, the experts / ep this rank holds."""
    r = cfg.lora.rank
    if r <= 0:
        return 0.0
    h, f = hf["hidden_size"], hf["intermediate_size"]
    q, kv = hf["num_attention_heads"] * head_dim(hf), hf["num_key_value_heads"] * head_dim(hf)
    shapes = {"linear_qkv": (h, q + 2 * kv, False), "linear_proj": (q, h, True), "linear_fc1": (h, 2 * f, False),
              "linear_fc2": (f, h, True)}  # (in, out, row-parallel)
    layers = hf["num_hidden_layers"]
    dense = sum(not is_moe_layer(hf, i) for i in range(layers))
    total = 0.0
    kinds = lora_targets(cfg.lora)
    if "experts" in kinds:
        fe = int(hf.get("moe_intermediate_size") or f)
        per_expert = r * (h + 2 * fe / etp) + r * (fe / etp + h)  # fc1 [2fe, h] column-, fc2 [h, fe] row-parallel
        total += moe_layers(hf) * num_experts(hf) / ep * per_expert
    for kind in (k for k in kinds if k != "experts"):
        inp, out, row = shapes[kind]
        per_layer = r * inp / tp + r * out if row else r * inp + r * out / tp
        total += per_layer * (dense if kind in ("linear_fc1", "linear_fc2") else layers)
    return total
