"""megatron-core's backward through a frozen linear layer (LoRA's base) on a [tokens, 1, out] gradient whose size-1
dimension has an odd stride, as a row-parallel layer's arrives: the input gradient and the peak memory added, before
and after ``compat.megatron.frozen_linear_backward_in_2d``. Run with ``MALLOC_MMAP_THRESHOLD_=65536`` (see
``engines.memory.peak_rss_added``); prints one JSON line."""

from __future__ import annotations

import json

import torch


def main() -> None:
    from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight

    from megarl.compat.megatron import frozen_linear_backward_in_2d
    from megarl.engines.memory import peak_rss_added

    tokens, inp, out = 512, 1536, 576
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out, inp, generator=g).to(torch.bfloat16)
    x = torch.randn(tokens, 1, inp, generator=g).to(torch.bfloat16)
    grad = torch.randn(1, tokens, out, generator=g).to(torch.bfloat16).transpose(0, 1)  # stride (out, tokens·out, 1)

    def backward() -> torch.Tensor:
        xi = x.clone().requires_grad_(True)
        LinearWithFrozenWeight.apply(xi, weight, None, False, None).backward(grad)
        return xi.grad

    runs = {}
    for name in ("megatron", "2d"):
        if name == "2d":
            frozen_linear_backward_in_2d()
        result = {}
        peak = peak_rss_added(lambda: result.update(grad=backward()))  # noqa: B023  (called at once)
        runs[name] = (peak, result["grad"])
    expected = (grad.float().reshape(tokens, out) @ weight.float()).reshape(tokens, 1, inp)
    print(json.dumps({"weight_copies_bytes": tokens * inp * out * 2,
                      "between": float((runs["2d"][1].float() - runs["megatron"][1].float()).abs().max()),
                      **{f"peak_{n}": p for n, (p, _) in runs.items()},
                      **{f"gap_{n}": float((gi.float() - expected).abs().max() / expected.abs().max())
                         for n, (_, gi) in runs.items()}}), flush=True)


if __name__ == "__main__":
    main()
