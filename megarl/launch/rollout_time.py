"""Seconds of a step's rollout and weight sync (``step_time.py`` has training and how the three combine).

    rollout  = prefill + decode + recompute, replicas in parallel, each with sequences / replicas of the step
      prefill   compute-bound: prompt tokens · (2·N_layers + 2·L·q·prompt) + 2·V·h for each prompt's last position
                (vLLM computes logits there alone), / (engine TP × peak × MFU), N_layers the active parameters that
                multiply less the output head (and the input embedding)
      decode    memory-bound: a decode step of batch b reads the engine's weights (dense part and the output
                head, tied to the embedding or not; for an MoE the experts its b tokens touch: E·(1 − (1 −
                topk/E)^b) per layer, at HBM × ``MOE_READ_EFFICIENCY``, vLLM's fused-MoE kernel's), b sequences' KV
                cache at the mean context and the sampler's passes over b × vocabulary (``SAMPLER_BYTES`` an entry,
                on every engine TP rank), per GPU / (HBM × ``HBM_EFFICIENCY``), or its FLOPs if slower, b · (2·N +
                4·L·q·context) (one query against the whole context: QKᵀ and AV, 2·q·context each, nothing
                masked); + 2·L all-reduces of b·h·w and one all-gather of the logits, b·V·w, between engine TP
                ranks (latency + bytes over NVLink, the network when the engine spans nodes); b = min(engine.slots,
                sequences per replica, what the engine's KV cache holds at the sequences' mean length): the cache
                ``engine.kv_cache_gib``, or with ``engine.gpu_memory_utilization`` what that share of the GPU leaves
                after the engine's weights and CUDA graphs (``memory.engine_reserved_gib``); steps = sequences ·
                response / b, + the tail (rollout.max_new_tokens − response: the longest sequence ends last) in sync
                mode, or / ((1 − bubble)(1 − waste)) with the mode's measured bubble and waste (on_policy, partial)
                or ``--bubble``
      recompute vLLM admits min(engine.slots, sequences per replica) at once, whatever their final length: where
                its cache holds fewer (b), it preempts the rest when the cache fills (at K / admitted tokens each,
                K the cache's tokens) and prefills their context again later (vLLM's V1 scheduler preempts by
                recompute): (admitted − b) · K / admitted tokens at prefill's rate (all of them: prefix caching may
                keep some, which this does not count)
    sync     = weights to the engines + sleep/wake + offload
      weights   the engine's bytes per engine GPU (N_total · w / engine TP; LoRA: the adapters') at the lesser of
                the link (NVLink in a node, the network across nodes) and a peer's measured refit rate: colocated
                ``REFIT_COLOCATED_GBPS``, disaggregated ``REFIT_GBPS`` + ``REFIT_LATENCY_S``
      sleep     level 1: the engine's weights to host and back (2 × over the host link); level 2: dropped and
                refilled by the sync itself; 0: nothing
      offload   trainer.offload_during_rollout: gradients and optimizer state (the critic's too) and a frozen
                reference's weights to host and back
"""

from __future__ import annotations

import math

from megarl.config.schema import RunConfig
from megarl.launch.efficiency import (
    HBM_EFFICIENCY,
    MOE_READ_EFFICIENCY,
    REFIT_COLOCATED_GBPS,
    REFIT_GBPS,
    REFIT_LATENCY_S,
    SAMPLER_BYTES,
)
from megarl.launch.gpus import Gpu
from megarl.launch.layout import Layout
from megarl.launch.memory import GIB, engine_bytes, kv_bytes_per_token, offloaded
from megarl.launch.model_size import Counts, adapter_params, head_dim, moe_layers
from megarl.launch.step_time import MODE_MEASURED, Work, multiplying_params, peak_flops
from megarl.models.hf_config import num_experts

NVLINK_LATENCY_S = 10e-6
NETWORK_LATENCY_S = 30e-6
"""Per collective, a small message's time (NCCL's all-reduce latency within a node and across nodes)."""


def decode_batch(hf: dict, cfg: RunConfig, lay: Layout, work: Work, kv_gib: float | None = None) -> int:
    """Sequences one replica decodes at once: min(engine.slots, its share of the step, what its KV cache holds at
    the sequences' mean full length). ``kv_gib``: the cache each engine GPU reserves (``memory_gib``'s kv_cache:
    ``engine.gpu_memory_utilization``'s share when set); None: ``engine.kv_cache_gib``."""
    per_token = kv_bytes_per_token(hf, lay.engine_tp, engine_bytes(cfg, cfg.trainer.precision))
    cache = cfg.engine.kv_cache_gib if kv_gib is None else kv_gib
    held = int(cache * GIB // (per_token * (work.prompt_tokens + work.response_tokens)))
    return max(1, min(cfg.engine.slots, math.ceil(work.sequences / lay.engine_replicas), held))


def rollout_time(counts: Counts, hf: dict, cfg: RunConfig, lay: Layout, gpu: Gpu, work: Work,
                 kv_gib: float | None = None) -> dict:
    """The engines' seconds per step (the module docstring's rollout); ``kv_gib`` as for ``decode_batch``."""
    e, we = lay.engine_tp, engine_bytes(cfg, cfg.trainer.precision)
    h, layers, q = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"] * head_dim(hf)
    b = decode_batch(hf, cfg, lay, work, kv_gib)
    per_replica = work.sequences / lay.engine_replicas
    vocab = hf["vocab_size"]
    head = vocab * h  # the output head, read whole each step, tied to the input embedding (looked up) or not
    dense = counts.attention + counts.dense + head
    experts, moe = num_experts(hf), moe_layers(hf)
    touched = experts * (1 - (1 - int(hf.get("num_experts_per_tok") or 0) / experts) ** b) if experts else 0
    expert_size = counts.experts / (moe * experts) if experts else 0
    weight_bytes = (dense + moe * touched * expert_size) * we / e
    context = work.prompt_tokens + work.response_tokens / 2
    kv_bytes = b * context * kv_bytes_per_token(hf, e, we)
    sampler_bytes = b * vocab * SAMPLER_BYTES  # each engine TP rank samples from the all-gathered logits
    bandwidth = gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY
    peak = peak_flops(cfg, gpu) * work.mfu
    n = multiplying_params(counts, hf)
    expert_bytes = moe * touched * expert_size * we / e
    memory_s = (weight_bytes - expert_bytes + kv_bytes + sampler_bytes) / bandwidth + expert_bytes / (
        gpu.hbm_tbps * 1e12 * MOE_READ_EFFICIENCY)
    flops_s = b * (2 * n + 4 * layers * q * context) / (e * peak)
    across = e > (lay.engine_gpus or lay.gpus_per_node)  # (engine GPUs inside a node: within it)
    link, latency = ((gpu.network_gbps, NETWORK_LATENCY_S) if across else (gpu.nvlink_gbps, NVLINK_LATENCY_S))
    # 2·L all-reduces of b·h·w (ring: twice the message) and the logits' all-gather, b·V·w, between the ranks
    traffic_s = b * (2 * layers * h * we * 2 + vocab * we) * (e - 1) / e / (link * 1e9)
    comm_s = (2 * layers + 1) * latency + traffic_s if e > 1 else 0.0
    step_s = max(memory_s, flops_s) + comm_s
    useful = per_replica * work.response_tokens / b
    bubble, waste = (work.bubble, 0.0) if work.bubble is not None else MODE_MEASURED.get(cfg.rollout.mode, (0, 0))
    tail = max(0, work.max_response - work.response_tokens) if cfg.rollout.mode == "sync" and work.bubble is None \
        else useful * (1 / ((1 - bubble) * (1 - waste)) - 1)
    # a prefill multiplies every position by the layers, only its last by the output head
    prefill_s = per_replica * (work.prompt_tokens * (2 * counts.in_layers + 2 * layers * q * work.prompt_tokens)
                               + 2 * head) / (e * peak)
    decode_s = (useful + tail) * step_s
    admitted = min(cfg.engine.slots, math.ceil(per_replica))
    cache = (cfg.engine.kv_cache_gib if kv_gib is None else kv_gib) * GIB / kv_bytes_per_token(hf, e, we)
    preempted = max(0, admitted - b) if b < admitted else 0
    at = min(cache / admitted, work.prompt_tokens + work.response_tokens)  # each one's context when preempted
    recompute_s = preempted * (at * (2 * counts.in_layers + 2 * layers * q * at) + 2 * head) / (e * peak)
    # The simulator's engine step: base + per_seq × active sequences (weights and latency; KV and traffic per seq).
    per_seq_s = (kv_bytes + sampler_bytes) / b / bandwidth + (traffic_s / b if e > 1 else 0.0)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "recompute_s": recompute_s, "preempted": preempted,
            "total_s": prefill_s + decode_s + recompute_s, "replicas": lay.engine_replicas, "engine_tp": e,
            "batch": b, "decode_step_s": step_s, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "sampler_bytes":
            sampler_bytes, "comm_s": comm_s, "across_nodes": across, "compute_bound": flops_s > memory_s,
            "steps": useful + tail, "useful_steps": useful, "tail_steps": tail, "bubble": bubble, "waste": waste,
            "step_base_s": max(step_s - b * per_seq_s, 0.0), "step_per_seq_s": per_seq_s,
            "kv_cache_gib": cfg.engine.kv_cache_gib if kv_gib is None else kv_gib}


def sync_time(counts: Counts, hf: dict, cfg: RunConfig, lay: Layout, gpu: Gpu, trainer_gib: dict) -> dict:
    """Weight sync, sleep/wake and offload seconds per step (the module docstring's sync). ``trainer_gib``:
    ``memory_gib``'s parts (the gradients and optimizer state an offload moves)."""
    we = engine_bytes(cfg, cfg.trainer.precision)
    synced = adapter_params(hf, cfg) or counts.total  # LoRA: the adapters alone (the engine keeps its base)
    per_gpu = synced * we / lay.engine_tp
    if lay.colocated:
        path = "network" if lay.engine_tp > lay.gpus_per_node else "NVLink"
    else:  # from the trainer's ranks: within the node when trainer and replicas share one node
        path = "NVLink" if lay.engine_gpus and lay.nodes == 1 else "network"
    link = gpu.network_gbps if path == "network" else gpu.nvlink_gbps
    rate = min(link, REFIT_COLOCATED_GBPS if lay.colocated else REFIT_GBPS)
    transfer = per_gpu / (rate * 1e9) + (0.0 if lay.colocated else REFIT_LATENCY_S)
    host = gpu.host_gbps * 1e9
    sleep = 2 * counts.total * we / lay.engine_tp / host if lay.colocated and lay.sleep_level == 1 else 0.0
    offload = 2 * offloaded(trainer_gib) * GIB / host if lay.offload else 0.0
    return {"transfer_s": transfer, "sleep_s": sleep, "offload_s": offload, "total_s": transfer + sleep + offload,
            "bytes": per_gpu, "path": path, "rate_gbps": rate}
