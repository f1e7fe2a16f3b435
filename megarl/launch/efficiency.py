"""The step-time model's named efficiencies, each a constant with its published source (docs/cluster.md cites them),
and the one derived term: the efficiency of a step's expert GEMMs from its tokens per expert.

Nothing here is fitted to the step times docs/cluster.md compares against: the constants are kernel and system
measurements of others (Megatron's training throughput, NeMo-RL's weight transfer), the expert GEMMs' efficiency a
roofline of the GEMMs' own shapes on the GPU's figures.
"""

from __future__ import annotations

import math

HBM_EFFICIENCY = 0.7
"""The share of HBM bandwidth memory-bound kernels reach (a decode step's reads, Adam's pass, small GEMMs' operands):
STREAM-like copies on H100 reach ~90%, vLLM's paged-attention and GEMV kernels at RL batch sizes less."""
MFU = {"dense": 0.40, "moe": 0.06}
"""Model FLOP utilisation of training, a share of the bf16 (or FP8) peak, by this model's FLOP count (no input
embedding, the causal half of attention). Dense: megatron-core's published runs on H100 reach 40–47% (GPT-3 175B,
Llama 3), and NeMo-RL v0.3's published Llama-3.1-8B GRPO phases (28 s training + 18 s logprob forwards of 2048 ×
~945 tokens on 8 H100) are 0.40. MoE: NeMo-RL v0.3's published Qwen3-30B-A3B GRPO phases (50 s training + 23 s
logprob forwards of 2048 × ~3400 tokens on 64 H100, megatron-core, token-dropless) are 0.06; Megatron-Bridge's
tuned dropless pre-training of the same model on 16 H100 (121 model TFLOP/s a GPU in FP8, NeMo 25.11) is 0.12, the
ceiling. Either runs its expert GEMMs at ~1–4k tokens an expert, where ``expert_gemm_efficiency`` is 1: the figure
is the rest of an MoE layer's cost (routing, permutation, dropless host syncs). ``--mfu`` replaces it with yours."""
MOE_READ_EFFICIENCY = 0.28
"""The share of HBM bandwidth vLLM's fused-MoE kernel reaches reading the experts a decode step touches: NeMo-RL
v0.3's published generation phase of Qwen3-30B-A3B GRPO (78 s for 2048 × ~3250 tokens, 16 replicas of TP 4 ×
batch 128, ~8 tokens an expert, on 64 H100) less the rest of each step (the sampler's passes included) at
``HBM_EFFICIENCY``."""
SAMPLER_BYTES = 70
"""Bytes of HBM traffic vLLM's V1 sampler moves per entry of its batch × vocabulary logits each decode step
(vllm/v1/sample/sampler.py; topk_topp_sampler.py without top-k or top-p, as RL samples): the bf16 logits made fp32
(2 read + 4 written), the log-softmax of the logprobs an RL rollout returns (two reading passes and the write over a
row too long for shared memory: 16), temperature (8), the softmax (16), the exponential draw (4) and the division by
it (12), argmax (4) and the sampled token's rank (4). Every engine TP rank samples the all-gathered logits. At a
151,936-token vocabulary and 256 sequences: 2.7 GB a step, as much as a 1.4B model's weights."""
GEMM_TILE = 128
"""Rows and columns of one output tile of a Hopper bf16 GEMM kernel (cuBLAS's and CUTLASS's 128×128 tiles)."""
SMS = {"a100": 108, "h100": 132, "h200": 132, "b200": 148}
"""Streaming multiprocessors of each preset (datasheets): the tiles one wave of a GEMM runs at once."""
REFIT_COLOCATED_GBPS = 3.2
"""Weight sync into colocated engines, per engine GPU: NeMo-RL v0.3's published refit of Llama-3.1-8B (16 GB into
each TP-1 engine GPU through CUDA IPC on the same GPUs, 5 s; its Llama-3.1-70B, 14 s, and Qwen3-32B, 7 s, are as
slow; its Qwen3-30B-A3B, 12 s, slower: ~19k expert tensors each handed over apart). A raw NVLink copy would take
0.04 s: handing each tensor over and the engine's weight loading, not a link, bound it."""
REFIT_LATENCY_S = 0.48
REFIT_GBPS = 19.7
"""Weight transfer into disaggregated engines, per engine GPU: a fixed cost and a rate from NeMo-RL's published
NCCL-reshard refit times on H100 (docs/design-docs/nccl-reshard-refit.md): Qwen3-30B-A3B bf16, 7.6 GB an engine
GPU (EP8×PP2 → TP8×DP2), 0.74–1.00 s; DeepSeek-V3 bf16, 42 GB an engine GPU (PP16×EP16 → TP32×DP8), 2.39–2.83 s:
the line through the two midpoints."""


def gemm_efficiency(m: float, n: int, k: int, rate: float, hbm: float, sms: int, grouped: int = 1) -> float:
    """The share of ``rate`` (FLOP/s a large GEMM reaches) ``grouped`` GEMMs of m × k by k × n, launched as one,
    reach: the roofline of their operands read and result written at ``hbm`` (B/s, bf16), times the wave efficiency
    of their output tiles (``GEMM_TILE`` square) over ``sms``."""
    if m <= 0:
        return 1.0
    flops, traffic = 2 * m * n * k, 2 * (m * k + k * n + m * n)
    roofline = (flops / rate) / max(flops / rate, traffic / hbm)
    tiles = math.ceil(m / GEMM_TILE) * math.ceil(n / GEMM_TILE) * grouped
    return roofline * tiles / (math.ceil(tiles / sms) * sms)


def expert_gemm_efficiency(hf: dict, tokens_per_expert: float, local_experts: int, etp: int, rate: float,
                           hbm: float, sms: int, grouped: bool) -> float:
    """How much of the MFU a step's expert GEMMs keep at ``tokens_per_expert``: each local expert's two GEMMs (gate
    and up fused, h × 2f/ETP; down, f/ETP × h), all ``local_experts`` in one grouped launch (Transformer Engine's
    grouped GEMM) or each expert's apart (one GEMM per expert: its tiles alone fill the GPU's SMs); the mean over
    their time (FLOPs 2:1). ``rate``: FLOP/s a large GEMM reaches (peak × dense MFU)."""
    h = hf["hidden_size"]
    f = int(hf.get("moe_intermediate_size") or hf["intermediate_size"]) // max(1, etp)
    group = local_experts if grouped else 1
    up = gemm_efficiency(tokens_per_expert, 2 * f, h, rate, hbm, sms, group)
    down = gemm_efficiency(tokens_per_expert, h, f, rate, hbm, sms, group)
    return 3 / (2 / up + 1 / down)
