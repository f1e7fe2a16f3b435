"""The engine side of the adapter-only sync (``lora.rank`` > 0): PEFT-named adapter tensors made a vLLM LoRA adapter
in one engine worker, registered beside the one it serves — the step of the all-or-nothing switch that can fail.

Both kinds of engine call it: the in-process engine on each trainer rank (``engines.adapters``, the ranks then agree
over the trainer's group) and each worker of a replica in a process of its own (``vllm_backend``'s
``megarl_add_adapter``, the replica's workers then agree through vLLM's ``collective_rpc``). What crosses a pipe or a
TCP link to a replica is ``packed`` (raw bytes per tensor: torch's own pickling would pass shared-memory handles,
which another node cannot open).
"""

from __future__ import annotations

import numpy as np
import torch

from megarl.models.hf_adapter import head_layout
from megarl.models.hf_config import is_moe_layer, num_experts, torch_dtype


def register(manager, tensors: dict, config: dict, adapter_id: int, hf: dict) -> str:
    """``tensors`` (PEFT-named) as vLLM adapter ``adapter_id`` registered in ``manager`` (a worker's
    ``lora_manager``) beside what it serves; '' when done, else why not (nothing registered)."""
    from vllm.lora.lora_model import LoRAModel  # deferred: vLLM, in engine processes only
    from vllm.lora.peft_helper import PEFTHelper

    try:
        helper = PEFTHelper.from_dict(dict(config))
        helper.validate_legal(manager.lora_config)
        model = LoRAModel.from_lora_tensors(adapter_id, tensors, helper, device="cpu",
                                            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size)
        check_adapter(tensors, helper.r, hf, served_modules(manager))
        manager._adapter_manager.add_adapter(model)
    except Exception as exc:  # noqa: BLE001  (every rank or worker agrees on the outcome: the caller's step)
        return f"{type(exc).__name__}: {exc}"
    return ""


def packed(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    """``tensors`` as (dtype, shape, bytes) each, to cross a pipe or a link to another node."""
    return {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape),
                t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()) for n, t in tensors.items()}


def unpacked(wire: dict) -> dict[str, torch.Tensor]:
    """``packed``'s tensors again."""
    return {n: torch.from_numpy(np.ascontiguousarray(raw)).view(torch_dtype(dtype)).reshape(shape)
            for n, (dtype, shape, raw) in wire.items()}


def module_shapes(hf: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each HF module an adapter may target, from the model's config (a routed expert's:
    ``experts.gate_proj`` …)."""
    h, f = hf["hidden_size"], hf["intermediate_size"]
    fe = int(hf.get("moe_intermediate_size") or f)
    heads, kv, d = head_layout(hf)
    return {"q_proj": (heads * d, h), "k_proj": (kv * d, h), "v_proj": (kv * d, h), "o_proj": (h, heads * d),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f),
            "experts.gate_proj": (fe, h), "experts.up_proj": (fe, h), "experts.down_proj": (h, fe)}


EXPERT_PARTS = ("experts.down_proj", "experts.gate_proj", "experts.up_proj")


def check_adapter(tensors: dict, rank: int, hf: dict, served: set[str]) -> None:
    """Raise ValueError unless ``tensors`` are a whole adapter of the model ``hf``: every module vLLM serves LoRA on,
    ``lora_A`` [rank, in] and ``lora_B`` [out, rank] of its shape, both of each, the same modules in every layer
    that has them (routed experts: every expert of every MoE layer, each its gate, up and down). vLLM itself takes
    a B a row short (and serves it wrong) or an adapter missing a layer (that layer then runs the base): a broken
    transfer must fail the load instead."""
    shapes, held = module_shapes(hf), {}
    for name, t in tensors.items():
        where, which, _ = name.rsplit(".", 2)
        layer, rest = where.split(".layers.", 1)[1].split(".", 1)
        module = wrapped = where.rsplit(".", 1)[-1]
        key = int(layer)
        parts = rest.split(".")
        if parts[:2] == ["mlp", "experts"] and len(parts) == 4 and parts[2].isdigit():  # vLLM's "experts.<e>.<part>"
            module, key, wrapped = f"experts.{parts[3]}", (key, int(parts[2])), ".".join(parts[1:])
        if wrapped not in served or module not in shapes:
            raise ValueError(f"{name}: the engine's model has no LoRA-capable module {module!r}")
        out, inp = shapes[module]
        want = (rank, inp) if which == "lora_A" else (out, rank)
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, the model's {module} takes {want}")
        held.setdefault(module, {}).setdefault(key, set()).add(which)
    moe = {i for i in range(hf["num_hidden_layers"]) if is_moe_layer(hf, i)}
    if any(m in held for m in EXPERT_PARTS):
        for m in EXPERT_PARTS:
            held.setdefault(m, {})
    for module, layers in held.items():
        if module in EXPERT_PARTS:
            expected = {(i, e) for i in moe for e in range(num_experts(hf))}
        else:
            dense = module in ("gate_proj", "up_proj", "down_proj")
            expected = {i for i in range(hf["num_hidden_layers"]) if not (dense and i in moe)}
        gaps = {"missing": expected - set(layers), "not in the model": set(layers) - expected,
                "without both lora_A and lora_B": {k for k, v in layers.items() if v != {"lora_A", "lora_B"}}}
        if any(gaps.values()):
            raise ValueError(f"the adapter's {module} is not whole (layers, or (layer, expert)): " + "; ".join(
                f"{what} {sorted(keys)[:8]}{' …' if len(keys) > 8 else ''}" for what, keys in gaps.items() if keys))


def served_modules(manager) -> set[str]:
    """The HF module names the engine takes adapters for (packed ones, qkv_proj and gate_up_proj, by their parts;
    the fused-MoE layer ``experts`` by each expert's, ``experts.<e>.gate_proj`` …; only those of
    ``lora_target_modules`` when the engine was started with them)."""
    adapter_manager = manager._adapter_manager
    packed_modules = adapter_manager.packed_modules_mapping
    served = {part for m in adapter_manager.supported_lora_modules for part in packed_modules.get(m, [m])}
    targets = manager.lora_config.target_modules
    return served & {part for t in targets for part in packed_modules.get(t, [t])} if targets else served
