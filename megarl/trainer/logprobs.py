"""Per-token logprobs from (possibly vocab-parallel) logits."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[label] per position; ``logits`` [b, s, V/tp], ``labels`` [b, s].

    Uses megatron-core's vocab-parallel cross entropy, so under TP each rank holds
    only its vocabulary shard and no rank materialises the full-vocab softmax.
    """
    from megatron.core import tensor_parallel

    scaled = logits.float() / temperature
    # vocab_parallel_cross_entropy wants [s, b, v]; it returns -log p(label).
    nll = tensor_parallel.vocab_parallel_cross_entropy(scaled.transpose(0, 1).contiguous(), labels.t().contiguous())
    return -nll.t()
