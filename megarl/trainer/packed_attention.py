"""Attention confined to each row of a packed micro-batch, for megatron-core's local (non-TE) layer spec.

megatron-core 0.16.1's ``DotProductAttention`` (the local spec's core attention) refuses packed sequences
(``assert packed_seq_params is None``); everything around it takes the ``thd`` format: ``SelfAttention`` squeezes
the batch dimension and applies RoPE per row from ``cu_seqlens`` (``_apply_rotary_pos_emb_thd``, plain torch,
positions restarting on each row), and reshapes the result back. This subclass takes the ``thd`` call: each row's
queries attend causally to that row's keys only (torch's ``scaled_dot_product_attention`` row by row, so the work
is Σ Lᵢ², not (Σ Lᵢ)² as a block-diagonal mask over the pack would cost). Without ``packed_seq_params`` it is
megatron's own attention, unchanged. Transformer Engine's ``TEDotProductAttention`` takes ``thd`` itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class PackedDotProductAttention(DotProductAttention):
    """megatron's local core attention, plus the packed (``thd``) format: rows from ``cu_seqlens_q``."""

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
        if key.shape[1] != query.shape[1]:  # grouped-query attention: each KV head serves a group of query heads
            # (expanded here, as megatron's own attention does: with enable_gqa SDPA runs its math kernel on CPU)
            group = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
        out = []
        # torch.split, not a slice per row: a slice's backward writes its gradient into a zeroed copy of the whole
        # pack, rows × pack work (measured: a third of a 32-row step)
        for q, k, v in zip(*(torch.split(x, lengths) for x in (query, key, value))):
            # [1, heads, L, head dim]: 4-D, or SDPA passes its fused CPU kernel over for the math one
            q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale)
            out.append(o[0].transpose(0, 1))
        return torch.cat(out).reshape(query.shape[0], -1)  # [t, heads · head dim]
