"""Attention confined to each row of a packed micro-batch, for megatron-core's local (non-TE) layer spec.

megatron-core 0.16.1's ``DotProductAttention`` (the local spec's core attention) refuses packed sequences
(``assert packed_seq_params is None``); everything around it takes the ``thd`` format: ``SelfAttention`` squeezes
the batch dimension and applies RoPE per row from ``cu_seqlens`` (``_apply_rotary_pos_emb_thd``, plain torch,
positions restarting on each row), and reshapes the result back. ``PackedDotProductAttention`` takes the ``thd``
call: each row's queries attend causally to that row's keys only, through torch's ``scaled_dot_product_attention``.
Without ``packed_seq_params`` it is megatron's own attention, unchanged. Transformer Engine's
``TEDotProductAttention`` takes ``thd`` itself.

Under context parallelism (``parallel.cp``; megatron's class refuses CP > 1 at construction, which the subclass
bypasses) a rank holds two chunks of every row (``distributed/context.py``): its queries are those, its keys and
values all-gathered over the CP group (``gather_sequence``: the backward sums the key and value gradients of every
rank's queries back to the rank holding them) and put in pack order, and a query at position p of a row sees the
row's keys at positions ≤ p: the rank's queries are put at their places in a pack of zeros and the whole pack goes
through the causal row attention above, whose outputs at those places are the rank's (the zero queries' are dropped,
and get no gradient). That spends a whole pack's attention on each CP rank (the linear layers, the MLP and their
activations are 1/CP; a rank's two chunks are not contiguous, and an explicit [queries × keys] mask would make torch's
CPU kernel keep it, L²/CP floats a layer) and keeps the reference path exact. On GPUs Transformer Engine's attention
does CP itself, each rank its share of the attention (``cp_comm_type``).

Rows of similar length go through SDPA together (``RowGroups``): a group is padded to its longest row at the end,
where causal attention keeps every real query off the padding, and the padded positions are dropped after. One SDPA
call per row cost more than the attention itself on CPU (a 256-row step: ~2.5 ms a call, thread-pool start-up), and
one call for the whole micro-batch would pay its longest row's length for every row; within a group the shortest row
is at least ``GROUP_RATIO`` of the longest (at most 1/ratio² the attention work of that row alone). A pack whose rows
all share one length is already that layout: it is viewed, not gathered. Grouped-query attention is SDPA's own
(``enable_gqa``, 4-D inputs: torch's fused CPU kernel), not KV heads copied per query head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megarl.distributed.context import chunk_positions, gather_sequence, gathered_order

GROUP_RATIO = 0.75
"""Rows go in one SDPA call while the shortest is at least this share of the longest."""


@dataclass
class RowGroups:
    """Where the rows of a pack go for batched attention: ``index`` (each group's rows, padded to its longest, as
    positions of the pack; padding reads position 0), ``inverse`` (each pack position's place in that layout) and
    each group's (rows, length)."""

    index: torch.Tensor
    inverse: torch.Tensor
    shapes: list[tuple[int, int]]
    identity: bool = False
    """The layout is the pack itself (rows of one length: one group, in pack order): nothing to gather."""

    @classmethod
    def of(cls, cu_seqlens: list[int], ratio: float = GROUP_RATIO) -> "RowGroups":
        lengths = [end - start for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        groups: list[list[int]] = []
        for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
            if groups and lengths[i] >= ratio * lengths[groups[-1][0]]:
                groups[-1].append(i)
            else:
                groups.append([i])
        index, inverse, offset = [], torch.empty(cu_seqlens[-1], dtype=torch.long), 0
        for group in groups:
            longest = lengths[group[0]]
            cols = torch.arange(longest)
            where = torch.tensor([cu_seqlens[i] for i in group]).unsqueeze(1) + cols
            valid = cols < torch.tensor([lengths[i] for i in group]).unsqueeze(1)
            index.append(torch.where(valid, where, 0).flatten())
            inverse[where[valid]] = (offset + torch.arange(len(group) * longest)).view(len(group), longest)[valid]
            offset += len(group) * longest
        return cls(torch.cat(index), inverse, [(len(g), lengths[g[0]]) for g in groups], len(set(lengths)) == 1)


@dataclass
class ContextPlan:
    """Where a CP rank's queries and the gathered keys sit in a pack: ``positions`` (this rank's, in its local order),
    ``inverse`` (each pack position's index among the CP ranks' local packs laid end to end) and the pack's
    ``row_groups``."""

    group: object
    positions: torch.Tensor
    inverse: torch.Tensor
    row_groups: RowGroups

    @classmethod
    def of(cls, cu_seqlens: list[int], group) -> "ContextPlan":
        cp = dist.get_world_size(group)
        positions, _ = chunk_positions(cu_seqlens, cp, dist.get_rank(group))
        return cls(group, positions, gathered_order(cu_seqlens, cp), RowGroups.of(cu_seqlens))


@dataclass
class RowPackedSeqParams(PackedSeqParams):
    """megatron's ``PackedSeqParams`` (``thd``) with the rows' grouping for ``PackedDotProductAttention``, computed
    once per micro-batch (every layer reads it), and under context parallelism the ranks' chunks (``context``)."""

    row_groups: RowGroups | None = field(default=None)
    context: ContextPlan | None = field(default=None)


class PackedDotProductAttention(DotProductAttention):
    """megatron's local core attention, plus the packed (``thd``) format: rows from ``cu_seqlens_q``; under context
    parallelism, each rank's chunks of them against every key of their rows."""

    def __init__(self, config, *args, **kwargs):
        cp = config.context_parallel_size  # megatron-core 0.16.1 asserts CP 1 ("only supported by TE"): the CP path
        config.context_parallel_size = 1  # is this class's own, on packed rows (``_context_parallel``)
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            config.context_parallel_size = cp

    def _context_parallel(self, query, key, value, plan: ContextPlan, scale: float, dropout: float):
        """This rank's queries [t/cp, heads, head dim] against their rows' keys and values of every CP rank, causal
        by position in the row → [t/cp, heads·head dim] (the module docstring)."""
        inverse, positions = plan.inverse.to(key.device), plan.positions.to(query.device)
        key, value = (gather_sequence(x, plan.group).index_select(0, inverse) for x in (key, value))
        whole = query.new_zeros((key.shape[0], *query.shape[1:])).index_copy(0, positions, query)
        return self._rows(whole, key, value, plan.row_groups, scale, dropout).index_select(0, positions)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if self.config.softmax_type != "vanilla" or attention_bias is not None:
            raise NotImplementedError("packed sequences on the local layer spec: vanilla softmax, no attention bias")
        # [t, heads, head dim] each (t: the pack); the query-key scale as megatron applies it (its layer scaling
        # divides softmax_scale by a coefficient the softmax multiplies back)
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        dropout = self.attention_dropout.p if self.training else 0.0
        if (context := getattr(packed_seq_params, "context", None)) is not None:
            return self._context_parallel(query, key, value, context, scale, dropout)
        plan = getattr(packed_seq_params, "row_groups", None) or RowGroups.of(packed_seq_params.cu_seqlens_q.tolist())
        return self._rows(query, key, value, plan, scale, dropout)

    def _rows(self, query, key, value, plan: RowGroups, scale: float, dropout: float):
        """Each row of a pack [t, heads, head dim] (q, k, v) attending causally to its own keys → [t, heads·head dim],
        rows of similar length through one SDPA call (``RowGroups``)."""
        dims = [(x.shape[1], x.shape[2]) for x in (query, key, value)]  # (heads, head dim): fewer KV heads under GQA
        if plan.identity:
            parts = [(query,), (key,), (value,)]
        else:  # one gather per tensor and torch.split (its backward one cat): a slice per row gave each row a backward
            # that wrote into a zeroed copy of the whole pack (measured: a third of a 32-row step)
            plan_index = plan.index.to(query.device)
            sizes = [rows * length for rows, length in plan.shapes]
            parts = [torch.split(x.index_select(0, plan_index), sizes) for x in (query, key, value)]
        out = []
        for (rows, length), *qkv in zip(plan.shapes, *parts):
            # [rows, heads, L, head dim]: 4-D, or SDPA passes its fused CPU kernel over for the math one
            q, k, v = (x.view(rows, length, *d).transpose(1, 2) for x, d in zip(qkv, dims))
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale,
                                               enable_gqa=k.shape[1] != q.shape[1])
            out.append(o.transpose(1, 2).reshape(rows * length, -1))
        if plan.identity:
            return out[0]
        return torch.cat(out).index_select(0, plan.inverse.to(query.device))
