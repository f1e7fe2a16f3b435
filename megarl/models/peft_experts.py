"""Routed experts' LoRA adapters in PEFT's two layouts, one into the other.

Per expert (what vLLM's fused-MoE LoRA takes in memory, and PEFT over a model whose experts are modules of their
own): ``…mlp.experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj``, each ``lora_A`` [r, in] and ``lora_B`` [out, r],
gate and up sharing one A. Fused (PEFT's ``target_parameters`` over transformers' ``Qwen3MoeExperts``, whose
``gate_up_proj`` [E, 2f, h] and ``down_proj`` [E, h, f] hold every expert; ``peft.tuners.lora.ParamWrapper``): one
adapter pair per layer and parameter, the first targeted parameter wrapped innermost::

    …mlp.experts.base_layer.lora_A  [E·r, h]   gate_up_proj: expert e's A in rows e·r … e·r + r − 1
    …mlp.experts.base_layer.lora_B  [2f, E·r]  column i·E + e: row i of expert e's B, its rows gate then up
    …mlp.experts.lora_A / lora_B    [E·r, f] / [h, E·r]   down_proj, likewise

so ``B.reshape(out, r, E)[..., e] @ A.reshape(E, r, in)[e]`` is expert e's update (PEFT's ``get_delta_weight``).
"""

from __future__ import annotations

import re

import torch

TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
"""PEFT's ``target_parameters`` for the fused layout, in its wrapping order (gate_up_proj innermost: ``base_layer``)."""
PER_EXPERT = re.compile(r"^(?P<layer>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<part>gate_proj|up_proj|down_proj)"
                        r"\.lora_(?P<which>[AB])\.weight$")
FUSED = re.compile(r"^(?P<layer>.+\.mlp\.experts)(?P<gate_up>\.base_layer)?\.lora_(?P<which>[AB])"
                   r"(?:\.[\w-]+)?\.weight$")
"""A fused-layout tensor (an adapter name before ``.weight``, as some PEFT versions save, allowed)."""


def fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors → the fused layout (every other tensor as it is). Each layer's experts must be 0 … E − 1,
    each with gate, up (one A) and down."""
    out, layers = {}, {}
    for name, t in tensors.items():
        m = PER_EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        layers.setdefault(m["layer"], {}).setdefault(int(m["e"]), {})[m["part"], m["which"]] = t
    for layer, experts in layers.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"{layer}: experts {sorted(experts)}, not 0 … {len(experts) - 1}")
        per = [experts[e] for e in range(len(experts))]
        if any(not torch.equal(x["gate_proj", "A"], x["up_proj", "A"]) for x in per):
            raise ValueError(f"{layer}: gate_proj and up_proj have different lora_A (the fused layout shares one)")
        gate_up_b = [torch.cat([x["gate_proj", "B"], x["up_proj", "B"]]) for x in per]
        out[f"{layer}.base_layer.lora_A.weight"] = torch.cat([x["gate_proj", "A"] for x in per])
        out[f"{layer}.base_layer.lora_B.weight"] = _columns(gate_up_b)
        out[f"{layer}.lora_A.weight"] = torch.cat([x["down_proj", "A"] for x in per])
        out[f"{layer}.lora_B.weight"] = _columns([x["down_proj", "B"] for x in per])
    return out


def _columns(bs: list[torch.Tensor]) -> torch.Tensor:
    """Experts' B [out, r] each → [out, r·E], column i·E + e holding expert e's column i."""
    return torch.stack(bs, dim=-1).reshape(bs[0].shape[0], -1).contiguous()


def split_experts(tensors: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """The fused layout → per-expert tensors (every other tensor as it is); ``rank``: the adapter's r."""
    out, fused = {}, {}
    for name, t in tensors.items():
        m = FUSED.match(name)
        if m is None:
            out[name] = t
            continue
        fused.setdefault((m["layer"], bool(m["gate_up"])), {})[m["which"]] = t
    for (layer, gate_up), ab in fused.items():
        what = f"{layer}{'.base_layer' if gate_up else ''}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{what}: lora_A and lora_B are needed, found {sorted(ab)}")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] % rank or b.shape[1] != a.shape[0]:
            raise ValueError(f"{what}: lora_A {list(a.shape)}, lora_B {list(b.shape)} are not E experts of rank "
                             f"{rank} (A [E·r, in], B [out, E·r])")
        experts = a.shape[0] // rank
        b = b.reshape(b.shape[0], rank, experts)
        for e in range(experts):
            a_e, b_e = a[e * rank:(e + 1) * rank].contiguous(), b[..., e].contiguous()
            parts = zip(("gate_proj", "up_proj"), b_e.chunk(2)) if gate_up else [("down_proj", b_e)]
            for part, piece in parts:
                out[f"{layer}.{e}.{part}.lora_A.weight"] = a_e.clone()
                out[f"{layer}.{e}.{part}.lora_B.weight"] = piece.contiguous()
    return out
