"""Context parallelism's token order and its one collective: which positions of a packed sequence each CP rank holds,
and the all-gather (with its gradient) that lets a rank's queries see every key of their rows.

Each segment of a pack (a row, padded to a multiple of 2·CP, or the pack's padding) is cut into 2·CP equal chunks;
CP rank i holds chunks i and 2·CP−1−i (megatron's load-balanced order: under causal attention every rank gets one
early, cheap chunk and one late, expensive one), each segment's two chunks side by side::

    CP 2, a row of 8 positions    0 1 | 2 3 | 4 5 | 6 7        chunks 0..3 of 2 positions
    rank 0 holds                  0 1           6 7            chunks 0 and 3
    rank 1 holds                        2 3 4 5                chunks 1 and 2

A rank's local pack is those chunks of every segment, in segment order: its ``cu_seqlens`` are the pack's divided by
CP. Transformer Engine's ``thd`` attention with CP (``thd_get_partitioned_indices``) and megatron's RoPE of packed rows
under CP (``_get_thd_freqs_on_this_cp_rank``) read the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def chunk_positions(cu_seqlens: torch.Tensor | list[int], cp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CP rank ``rank``'s positions of a pack whose segments start at ``cu_seqlens`` (each a multiple of 2·CP long),
    in its local order: (their index in the pack [t/CP], their position within their segment [t/CP])."""
    cu = torch.as_tensor(cu_seqlens, dtype=torch.long).cpu()
    lengths = cu[1:] - cu[:-1]
    if cp == 1:
        within = torch.arange(int(cu[-1])) - torch.repeat_interleave(cu[:-1], lengths)
        return torch.arange(int(cu[-1])), within
    if bool((lengths % (2 * cp)).any()):
        raise ValueError(f"context parallelism {cp}: every segment must be a multiple of 2·CP = {2 * cp} positions, "
                         f"got lengths {lengths.tolist()}")
    half = lengths // (2 * cp)  # a chunk's positions, per segment
    local = 2 * half
    j = torch.arange(int(local.sum())) - torch.repeat_interleave(torch.cumsum(local, 0) - local, local)
    c = torch.repeat_interleave(half, local)
    within = torch.where(j < c, rank * c + j, (2 * cp - 1 - rank) * c + (j - c))
    return torch.repeat_interleave(cu[:-1], local) + within, within


def gathered_order(cu_seqlens: torch.Tensor | list[int], cp: int) -> torch.Tensor:
    """Where each position of the pack sits in the CP ranks' local packs laid end to end (rank 0's, rank 1's, ...):
    ``gathered[inverse]`` is the pack in its own order."""
    index = torch.cat([chunk_positions(cu_seqlens, cp, r)[0] for r in range(cp)])
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(len(index))
    return inverse


class _GatherSequence(torch.autograd.Function):
    """All-gather along the first dimension over a group; the backward sums each rank's gradient of every piece and
    hands each rank the sum for its own piece (a reduce-scatter): the piece's gradient from every rank's use of it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = dist.get_world_size(group)
        out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (torch < 2.13)
        all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        out = torch.empty((grad.shape[0] // size, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # (torch < 2.13)
        reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` [t, ...] of every rank of ``group`` laid end to end, rank by rank [size·t, ...], differentiably (each
    rank's piece gets the gradient of every rank's use of it)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group)
