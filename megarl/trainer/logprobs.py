"""Per-token logprobs and entropy from (possibly vocab-parallel) logits, without gathering the vocabulary."""

from __future__ import annotations

import torch
import torch.distributed as dist


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


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H = log Σ e^z − Σ p·z per position (z = logits / T), summed across TP vocabulary shards."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z = logits.float() / temperature
    tp = mpu.get_tensor_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1
    z_max = z.max(dim=-1, keepdim=True).values.detach()
    if tp > 1:
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    z = z - z_max
    e = torch.exp(z)
    denom = e.sum(dim=-1)
    weighted = (e * z).sum(dim=-1)
    if tp > 1:
        denom = reduce_from_tensor_model_parallel_region(denom)
        weighted = reduce_from_tensor_model_parallel_region(weighted)
    return torch.log(denom) - weighted / denom
