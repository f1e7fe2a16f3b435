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
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        out = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))  # [heads, L, head dim]
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale,
                                               enable_gqa=k.shape[0] != q.shape[0])
            out.append(o.transpose(0, 1))
        return torch.cat(out).reshape(query.shape[0], -1)  # [t, heads · head dim]
