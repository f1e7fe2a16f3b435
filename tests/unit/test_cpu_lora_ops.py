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
