"""Routed experts' adapters: PEFT's two layouts (``models/peft_experts.py``), the engine-side check of an adapter with
experts (``weight_sync.adapter_load.check_adapter``) and the plan's count of them (``launch.model_size``). Pure
tensors and config; the trainer, the export through ``peft`` and vLLM's layer are ``tests/distributed/test_lora*.py``
and ``tests/engine/test_lora_sync.py``."""

import pytest
import torch

from megarl.config import load_config
from megarl.launch.model_size import adapter_params
from megarl.models.peft_experts import fuse_experts, split_experts
from megarl.models.tiny import TinyShape, hf_config
from megarl.weight_sync.adapter_load import check_adapter

MOE = hf_config(TinyShape(family="qwen3_moe"), eos_id=1, pad_id=0)
R, E, H, F = 4, 3, 8, 6
LAYER = "base_model.model.model.layers.0.mlp.experts"


def per_expert(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random per-expert adapters of one layer: gate and up sharing A, as the trainer's linear_fc1 gives them."""
    g, out = torch.Generator().manual_seed(seed), {}
    for e in range(E):
        a1, a2 = torch.randn(R, H, generator=g), torch.randn(R, F, generator=g)
        for part, a, rows in (("gate_proj", a1, F), ("up_proj", a1, F), ("down_proj", a2, H)):
            out[f"{LAYER}.{e}.{part}.lora_A.weight"] = a.clone()
            out[f"{LAYER}.{e}.{part}.lora_B.weight"] = torch.randn(rows, R, generator=g)
    return out


def test_fused_layout_gives_each_expert_its_update_as_peft_computes_it():
    tensors = per_expert()
    other = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(R, H)}
    fused = fuse_experts({**tensors, **other})
    assert fused.keys() == {*other, f"{LAYER}.base_layer.lora_A.weight", f"{LAYER}.base_layer.lora_B.weight",
                            f"{LAYER}.lora_A.weight", f"{LAYER}.lora_B.weight"}
    a, b = fused[f"{LAYER}.base_layer.lora_A.weight"], fused[f"{LAYER}.base_layer.lora_B.weight"]
    assert a.shape == (E * R, H) and b.shape == (2 * F, E * R)
    # peft's ParamWrapper.get_delta_weight for a 3D [E, out, in] parameter: einsum over B [out, r, E], A [E, r, in]
    delta = torch.einsum("ore,eri->eoi", b.reshape(2 * F, R, E), a.reshape(E, R, H))
    for e in range(E):
        gate = tensors[f"{LAYER}.{e}.gate_proj.lora_B.weight"] @ tensors[f"{LAYER}.{e}.gate_proj.lora_A.weight"]
        up = tensors[f"{LAYER}.{e}.up_proj.lora_B.weight"] @ tensors[f"{LAYER}.{e}.up_proj.lora_A.weight"]
        assert torch.allclose(delta[e], torch.cat([gate, up]), atol=1e-5)  # gate_up_proj's rows: gate, then up
    down = torch.einsum("ore,eri->eoi", fused[f"{LAYER}.lora_B.weight"].reshape(H, R, E),
                        fused[f"{LAYER}.lora_A.weight"].reshape(E, R, F))
    assert torch.allclose(down[1], tensors[f"{LAYER}.1.down_proj.lora_B.weight"] @
                          tensors[f"{LAYER}.1.down_proj.lora_A.weight"], atol=1e-5)
    back = split_experts(fused, R)
    assert back.keys() == {*tensors, *other} and all(torch.equal(back[k], v) for k, v in tensors.items())


def test_an_incomplete_or_inconsistent_expert_set_is_refused():
    tensors = per_expert()
    with pytest.raises(ValueError, match=r"experts \[0, 2\], not 0 … 1"):
        fuse_experts({k: v for k, v in tensors.items() if ".experts.1." not in k})
    tensors[f"{LAYER}.2.up_proj.lora_A.weight"] = tensors[f"{LAYER}.2.up_proj.lora_A.weight"] + 1
    with pytest.raises(ValueError, match="different lora_A"):
        fuse_experts(tensors)
    fused = fuse_experts(per_expert())
    with pytest.raises(ValueError, match=r"not E experts of rank 5"):
        split_experts(fused, 5)
    del fused[f"{LAYER}.lora_B.weight"]
    with pytest.raises(ValueError, match="lora_A and lora_B are needed"):
        split_experts(fused, R)


def moe_adapter(rank: int = R) -> dict[str, torch.Tensor]:
    """A whole adapter of the tiny Qwen3-MoE on every expert, PEFT-named per expert (what the sync sends)."""
    h, f, out = MOE["hidden_size"], MOE["moe_intermediate_size"], {}
    for layer in range(MOE["num_hidden_layers"]):
        for e in range(MOE["num_experts"]):
            for part, (rows, cols) in {"gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}.items():
                name = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{part}"
                out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = torch.zeros(rank, cols), torch.zeros(
                    rows, rank)
    return out


def test_the_engine_takes_an_expert_adapter_only_whole_and_where_it_serves_experts():
    served = {f"experts.{e}.{p}" for e in range(MOE["num_experts"]) for p in ("gate_proj", "up_proj", "down_proj")}
    check_adapter(moe_adapter(), R, MOE, served)
    with pytest.raises(ValueError, match="no LoRA-capable module 'experts.gate_proj'"):
        check_adapter(moe_adapter(), R, MOE, {"q_proj", "k_proj", "v_proj", "o_proj"})  # started without experts
    missing = {k: v for k, v in moe_adapter().items() if ".layers.2.mlp.experts.3.down_proj." not in k}
    with pytest.raises(ValueError, match=r"experts.down_proj is not whole.*missing \[\(2, 3\)\]"):
        check_adapter(missing, R, MOE, served)
    half = {k: v for k, v in moe_adapter().items() if k != "base_model.model.model.layers.0.mlp.experts.1."
            "gate_proj.lora_B.weight"}
    with pytest.raises(ValueError, match=r"without both lora_A and lora_B \[\(0, 1\)\]"):
        check_adapter(half, R, MOE, served)
    short = moe_adapter()
    short["base_model.model.model.layers.1.mlp.experts.0.up_proj.lora_B.weight"] = torch.zeros(1, R)
    with pytest.raises(ValueError, match=r"up_proj.lora_B.weight: shape \(1, 4\), the model's experts.up_proj"):
        check_adapter(short, R, MOE, served)


def test_the_plan_counts_every_experts_adapters_and_an_ep_ranks_share():
    cfg = load_config(None, [f"lora.rank={R}", "lora.targets=experts"])
    h, f = MOE["hidden_size"], MOE["moe_intermediate_size"]
    per_expert_params = R * (h + 2 * f) + R * (f + h)  # fc1: A [r, h], B [2f, r]; fc2: A [r, f], B [h, r]
    whole = MOE["num_hidden_layers"] * MOE["num_experts"] * per_expert_params
    assert adapter_params(MOE, cfg) == whole and adapter_params(MOE, cfg, ep=2) == whole / 2
    split = MOE["num_hidden_layers"] * MOE["num_experts"] * (R * (h + f) + R * (f / 2 + h))  # B of fc1, A of fc2
    assert adapter_params(MOE, cfg, etp=2) == split  # at expert TP 2, halved
