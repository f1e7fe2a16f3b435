"""``compat.vllm.cpu_lora_products_per_slot``: vLLM's CPU LoRA ops, patched to one product per adapter slot instead
of a copy of the slot's weights per token, give the original ops' results (rows through different slots, a
negative index, 3- and 4-dimensional weight stacks, bf16 outputs, assigned and accumulated writes)."""

from __future__ import annotations

import importlib

import pytest
import torch


@pytest.fixture(scope="module")
def ops():
    """The original ops (a fresh module object, before any patch) and the patched ones."""
    lora_ops = importlib.import_module("vllm.lora.ops.torch_ops.lora_ops")
    spec = importlib.util.spec_from_file_location("original_lora_ops", lora_ops.__file__)
    original = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(original)
    from megarl.compat.vllm import cpu_lora_products_per_slot

    cpu_lora_products_per_slot()
    from vllm.lora.punica_wrapper import punica_cpu

    assert punica_cpu.bgmv_shrink is lora_ops.bgmv_shrink and lora_ops.bgmv_shrink.megarl_patched
    return original, lora_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stack", [3, 4])
def test_patched_cpu_lora_ops_give_the_original_results(ops, dtype, stack):
    original, patched = ops
    g = torch.Generator().manual_seed(0)
    tokens, hidden, rank, out, slots = 11, 24, 4, 20, 3
    indices = torch.tensor([0, 2, 2, 1, 0, -1, 2, 0, 1, 1, 2])
    x = torch.randn(tokens, hidden, generator=g)
    a = torch.randn(slots, rank, hidden, generator=g)
    b = torch.randn(slots, out, rank, generator=g)
    if stack == 4:
        a, b = a.unsqueeze(1), b.unsqueeze(1)
    h = torch.randn(tokens, rank, generator=g)
    base = torch.randn(tokens, out + 6, generator=g).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}

    got, want = torch.zeros(tokens, rank, dtype=dtype), torch.zeros(tokens, rank, dtype=dtype)
    patched.bgmv_shrink(x, a, got, indices, 0.5)
    original.bgmv_shrink(x, a, want, indices, 0.5)
    torch.testing.assert_close(got, want, **tol)
    for add in (True, False):
        got, want = base.clone(), base.clone()
        patched.bgmv_expand(h, b, got, indices, add)
        original.bgmv_expand(h, b, want, indices, add)
        torch.testing.assert_close(got, want, **tol)
        got, want = base.clone(), base.clone()
        patched.bgmv_expand_slice(h, b, got, indices, 3, out, add)
        original.bgmv_expand_slice(h, b, want, indices, 3, out, add)
        torch.testing.assert_close(got, want, **tol)
    got, want = base.clone(), base.clone()  # a single row written to every row (the ops' own broadcast)
    patched.bgmv_expand(h[:1], b, got, indices[:1], True)
    original.bgmv_expand(h[:1], b, want, indices[:1], True)
    torch.testing.assert_close(got, want, **tol)


def test_moe_experts_with_lora_on_cpu_are_each_tokens_dense_sum():
    """``compat.vllm_moe_lora.experts_with_lora`` (what ``TritonExperts.apply`` runs on CPU tensors) against each
    token computed alone with every adapted expert's weights merged: W + B A in gate, up and down (B already scaled,
    as vLLM keeps it), tokens through two adapter slots, none (−1) and a disabled slot; an expert of another EP rank
    skipped; the router weight applied on the input instead."""
    from megarl.compat.vllm_moe_lora import experts_with_lora

    g = torch.Generator().manual_seed(0)
    m, k, n, e, r, slots, top = 7, 6, 5, 4, 2, 3, 2
    x = torch.randn(m, k, generator=g)
    w13, w2 = torch.randn(e, 2 * n, k, generator=g), torch.randn(e, k, n, generator=g)
    topk_ids = torch.stack([torch.randperm(e, generator=g)[:top] for _ in range(m)])
    topk_weights = torch.rand(m, top, generator=g)
    a13 = tuple(torch.randn(slots, e, r, k, generator=g) for _ in range(2))
    b13 = tuple(torch.randn(slots, e, n, r, generator=g) for _ in range(2))
    a2, b2 = (torch.randn(slots, e, r, n, generator=g),), (torch.randn(slots, e, k, r, generator=g),)
    enabled = torch.tensor([1, 1, 0])
    token_slots = torch.tensor([0, 1, -1, 2, 0, 1, -1])  # slot 2 is disabled: the base

    def dense(t: int, skip: int | None = None, on_input: bool = False) -> torch.Tensor:
        s, out = int(token_slots[t]), torch.zeros(k)
        for j in range(top):
            ex = int(topk_ids[t, j])
            if ex == skip:
                continue
            gate_w, up_w, down_w = w13[ex, :n], w13[ex, n:], w2[ex]
            if s >= 0 and enabled[s]:
                gate_w = gate_w + b13[0][s, ex] @ a13[0][s, ex]
                up_w = up_w + b13[1][s, ex] @ a13[1][s, ex]
                down_w = down_w + b2[0][s, ex] @ a2[0][s, ex]
            y = down_w @ (torch.nn.functional.silu(gate_w @ x[t]) * (up_w @ x[t]))
            out += y if on_input else topk_weights[t, j] * y
        return out

    lora = (a13, b13, a2, b2, enabled)
    got = experts_with_lora(x, w13, w2, topk_weights, topk_ids, token_slots, lora)
    assert torch.allclose(got, torch.stack([dense(t) for t in range(m)]), atol=1e-4)
    expert_map = torch.tensor([0, 1, -1, 3])  # expert 2 on another rank
    got = experts_with_lora(x, w13, w2, topk_weights, topk_ids, token_slots, lora, expert_map)
    assert torch.allclose(got, torch.stack([dense(t, skip=2) for t in range(m)]), atol=1e-4)
    got = experts_with_lora(x, w13, w2, topk_weights, topk_ids, token_slots, lora, weight_on_input=True)
    assert torch.allclose(got, torch.stack([dense(t, on_input=True) for t in range(m)]), atol=1e-4)
    base = experts_with_lora(x, w13, w2, topk_weights, topk_ids)  # no LoRA context: the plain experts
    assert torch.allclose(base, experts_with_lora(x, w13, w2, topk_weights, topk_ids, torch.full((m,), -1), lora))
