"""The trainer's LoRA adapters as a PEFT adapter: HF-named ``lora_A`` / ``lora_B`` tensors and ``adapter_config.json``,
what vLLM loads as a LoRA (the adapter-only sync) and ``peft`` loads over the base model (the export).

Each adapted Megatron layer maps onto the HF layers its base weight becomes (``hf_adapter.hf_parts``)::

    linear_qkv  A [r, h]    → q_proj, k_proj, v_proj: lora_A = A each (one input, shared)
                B [qkv, r]  → lora_B = B's rows split as the weight's are (per query group: ``qkv_from_megatron``)
    linear_fc1  A [r, h]    → gate_proj, up_proj: lora_A = A each
                B [2f, r]   → lora_B = B's gate rows, up rows
    linear_proj / linear_fc2 → o_proj / down_proj: lora_A = A, lora_B = B

exact, since ``B_q A x`` is the q rows of ``B A x``; a routed expert's linear_fc1 / linear_fc2 (``mlp.experts.
local_experts.<e>``) become ``mlp.experts.<e>.gate_proj`` … as a dense MLP's do. Adapters are gathered whole: the
split one of each layer over its TP group (joined as its base weight's shards are), the experts' over the EP group,
the pipeline stages' layers over the PP group. They are small (rank r: r · (in + out) a layer) — every rank holds
them all, as every engine rank needs them all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.config.schema import LoraConfig
from megarl.config.validate.lora import hf_modules
from megarl.models.hf_adapter import hf_parts, megatron_to_hf
from megarl.models.hf_config import num_experts
from megarl.models.peft_experts import TARGET_PARAMETERS
from megarl.models.sharding import global_name, join_tp_shards
from megarl.trainer.lora import LoraAdapter

EXPERT = ".mlp.experts.local_experts."
"""In a global Megatron name: a routed expert's layer."""
PREFIX = "base_model.model."
"""PEFT's prefix of a causal LM's module names (``PeftModelForCausalLM.base_model.model``)."""


def peft_config(lora: LoraConfig, base_model: str) -> dict:
    """``adapter_config.json`` of the adapters ``lora`` describes, over ``base_model`` (routed experts' as PEFT's
    ``target_parameters`` over transformers' fused experts: ``models/peft_experts.py``)."""
    targeted = hf_modules(lora)
    modules = [m for m in targeted if m != "experts"]
    experts = {"target_parameters": TARGET_PARAMETERS} if "experts" in targeted else {}
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "inference_mode": True, "modules_to_save": None, "init_lora_weights": True,
            "target_modules": modules, **experts,
            "base_model_name_or_path": str(base_model)}


def _local_adapters(module: torch.nn.Module):
    """(local base layer name, adapter) of one model chunk."""
    for name, sub in module.named_modules():
        if isinstance(getattr(sub, "lora", None), LoraAdapter):
            yield name, sub.lora


@torch.no_grad()
def gather_adapters(modules: list[torch.nn.Module], ps, hf_cfg: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every adapter whole, on every rank, on the host: global Megatron base layer name → (A [r, in], B [out, r]).
    Every rank of the trainer calls it (TP gathers, then one exchange over the expert ranks and the pipeline stages:
    pickled objects, which is why host copies: a pickled CUDA tensor comes back on its sender's device)."""
    layers, experts = hf_cfg["num_hidden_layers"], num_experts(hf_cfg)
    whole: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for vp, module in enumerate(modules):
        coords = ps.coords(vp)
        for local, ad in _local_adapters(module):
            weight = global_name(local.removeprefix("module.") + ".weight", layers, experts, coords)
            a, b = ad.a.detach(), ad.b.detach()
            if ad.tp > 1:
                split = a if ad.row else b
                shards = [torch.empty_like(split) for _ in range(ad.tp)]
                dist.all_gather(shards, split.contiguous(), group=ad.tp_group)
                joined = join_tp_shards(weight, shards)
                a, b = (joined, b) if ad.row else (a, joined)
            whole[weight.removesuffix(".weight")] = (a.to("cpu", copy=True), b.to("cpu", copy=True))
    if ps.ep > 1:  # each EP rank holds its own experts' adapters (whole by now); the rest is the same
        parts: list = [None] * ps.ep
        dist.all_gather_object(parts, {k: v for k, v in whole.items() if EXPERT in k}, group=ps.ep_group)
        whole = {k: v for part in [whole, *parts] for k, v in part.items()}
    if ps.pp > 1:
        parts = [None] * ps.pp
        dist.all_gather_object(parts, whole, group=ps.pp_group)
        whole = {k: v for part in parts for k, v in part.items()}
    return whole


def peft_tensors(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], hf_cfg: dict,
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``gather_adapters``' result under PEFT's names (``PREFIX`` + HF module + ``.lora_A.weight`` or
    ``.lora_B.weight``), cast to ``dtype`` (None: as they are). Each a copy of its own: q/k/v share one A, gate/up
    one A and halves of one B, and tensors that share memory cannot be saved (safetensors refuses them)."""
    out: dict[str, torch.Tensor] = {}

    def put(hf_weight: str, which: str, t: torch.Tensor) -> None:
        out[f"{PREFIX}{hf_weight.removesuffix('.weight')}.lora_{which}.weight"] = t.to(
            dtype=dtype or t.dtype, memory_format=torch.contiguous_format, copy=True)

    for base in sorted(adapters):
        a, b = adapters[base]
        for hf_weight in hf_parts(base + ".weight", hf_cfg)[1]:
            put(hf_weight, "A", a)
        for hf_weight, piece in megatron_to_hf([(base + ".weight", b)], hf_cfg):
            put(hf_weight, "B", piece)
    return out


def adapter_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
