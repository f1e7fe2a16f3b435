"""Seconds per RL step of a layout: training, rollout and weight sync, each from the model's shape, the batch and
the GPU's figures (``gpus.Gpu``). Pure arithmetic; every term keeps the inputs it was computed from.

    train    = compute + recompute + TP + EP + CP + PP bubble + DP + optimizer
      compute   FLOPs / (trainer GPUs × peak × MFU); FLOPs = T × (6·N_active + 6·L·q·s), T trained tokens
                (sequences × (prompt + response)), s their length, q the attention width (QKᵀ and AV, halved by
                the causal mask); a reference model (algo.kl_coef > 0) adds a forward, T × (2·N_active + 2·L·q·s)
      recompute trainer.recompute full: the layers' forward once more in the backward, T × (2·N_layers + 2·L·q·s)
                (N_layers: the active parameters less embedding and output head; ~+33% of the compute), and its TP
                all-reduces and EP all-to-alls (2 more each per layer); selective: the core attention's forward,
                T × 2·L·q·s. The plan counts expert GEMMs at the one MFU whether grouped (Transformer Engine) or not:
                the model has no per-expert GEMM efficiency term
      TP        per GPU: (T/DP) · (L/PP) · h · w · 4 all-reduces (2 forward, 2 backward; +2 for a reference
                forward, +2 under full recompute) · 2(TP−1)/TP bytes over NVLink
      EP        per GPU: T/(DP·TP) tokens · (L_moe/PP) · topk · h · w · 4 all-to-alls (dispatch and combine,
                forward and backward), the share (EP−1)/EP leaving the GPU: over NVLink to peers in the node,
                the network to the others
      CP        parallel.cp: per GPU, the keys and values of the other CP ranks' positions, each layer's all-gathered
                in the forward and their gradients reduce-scattered in the backward (Transformer Engine's p2p ring
                moves as many): (T/(DP·CP)) · (L/PP) · 2·kv/TP · w · 2 (+1 for a reference forward, +1 under full
                recompute) · (CP−1) bytes over NVLink, the network when TP·CP spans nodes; T/(DP·CP) stands for
                T/DP in TP, EP and the PP activations (a CP rank holds 1/CP of a micro-batch), and DP is DP × CP
      PP        the 1F1B bubble, (PP−1) / (micro-batches · VPP) × (compute + recompute + TP + EP), + the activations
                between stages: 2 (forward, backward) · (T/DP) · h · w over NVLink, the network when TP·PP
                spans nodes
      DP        per GPU: parameters · (4 B reduce-scatter of fp32 gradients + w all-gather of weights) ·
                (DP−1)/DP under the distributed optimizer (2 · 4 B all-reduce without); experts over the expert
                data-parallel group; over the network when the job has several nodes, else NVLink
      optimizer Adam's read and write of ~32 B per parameter of the rank's shard at HBM bandwidth
    rollout  = prefill + decode, replicas in parallel, each with sequences / replicas of the step
      prefill   compute-bound: prompt tokens · (2·N_active + 2·L·q·prompt) / (engine TP × peak × MFU)
      decode    memory-bound: a decode step of batch b reads the engine's weights (dense part, and for an MoE
                the experts its b tokens touch: E·(1 − (1 − topk/E)^b) per layer) and b sequences' KV cache at
                the mean context, per GPU / (HBM × 0.7), or its FLOPs if slower; + 2·L all-reduces of b·h·w
                between engine TP ranks (latency + bytes over NVLink, the network when the engine spans nodes);
                b = min(engine.slots, sequences per replica, what engine.kv_cache_gib holds); steps =
                sequences · response / b, + the tail (rollout.max_new_tokens − response: the longest sequence
                ends last) in sync mode, or / ((1 − bubble)(1 − waste)) with the mode's measured bubble and
                waste (on_policy, partial) or ``--bubble``
    sync     = weights to the engines + sleep/wake + offload
      weights   the engine's bytes per engine GPU (N_total · w / engine TP) over NVLink (colocated in a node),
                the network (an engine across nodes; disaggregated: the whole model once, broadcast, over NVLink
                when the trainer and its engine GPUs share one node)
      sleep     level 1: the engine's weights to host and back (2 × over the host link); level 2: dropped and
                refilled by the sync itself; 0: nothing
      offload   trainer.offload_during_rollout: gradients and optimizer state to host and back
    step     = train + rollout + sync (colocated, or rollout.overlap none); rollout.overlap one_step / async with
               disaggregated engines: max(train, rollout) + sync
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.config.schema import RunConfig
from megarl.launch.gpus import Gpu
from megarl.launch.layout import Layout
from megarl.launch.memory import GIB, WEIGHT_BYTES, engine_bytes, kv_bytes_per_token, microbatch_tokens, rank_params
from megarl.launch.model_size import Counts, head_dim, moe_layers
from megarl.models.hf_config import num_experts

HBM_EFFICIENCY = 0.7
"""The share of HBM bandwidth a decode step's reads reach (vLLM's kernels at the batch sizes of RL rollouts)."""
NVLINK_LATENCY_S = 10e-6
NETWORK_LATENCY_S = 30e-6
"""Per collective, a small message's time (NCCL's all-reduce latency within a node and across nodes)."""
OPTIMIZER_TRAFFIC = 32
"""Bytes Adam reads and writes per parameter of its shard (fp32 weight, gradient, m, v in; weight, m, v, bf16 out)."""
MFU = {"dense": 0.40, "moe": 0.25}
"""Default model FLOP utilisation: megatron-core's published dense runs on H100 reach 40–47%; MoE layers run
lower (grouped GEMMs, routing): 0.25 is an assumption to replace with your measured figure (``--mfu``)."""
MODE_MEASURED = {"on_policy": (0.17, 0.41), "partial": (0.08, 0.0)}
"""The rollout's bubble and wasted share per mode as measured on the real vLLM engine (bench/README.md: bubble
on-policy 15–19%, partial 6–10%; on-policy's useful tokens/s 0.96× sync at 1.64× its output: 41% discarded)."""


@dataclass(frozen=True)
class Work:
    """What a step does: its sequences, their mean prompt and response lengths, the response cap."""

    sequences: int
    prompt_tokens: int
    response_tokens: int
    max_response: int
    mfu: float
    bubble: float | None = None
    """The rollout's idle share (``--bubble``, e.g. the simulator's bubble_ratio); None: the mode's."""

    @property
    def tokens(self) -> int:
        return self.sequences * (self.prompt_tokens + self.response_tokens)


def work_of(cfg: RunConfig, hf: dict, prompt_tokens: int = 0, response_tokens: int = 0, mfu: float = 0.0,
            bubble: float | None = None) -> Work:
    """The step's work from the config: prompts × samples sequences; prompt and response lengths given, else half
    the prompt budget (engine.max_model_len − rollout.max_new_tokens) and half of rollout.max_new_tokens."""
    r = cfg.rollout
    prompt = prompt_tokens or max(1, (cfg.engine.max_model_len - r.max_new_tokens) // 2)
    response = response_tokens or max(1, r.max_new_tokens // 2)
    return Work(r.prompts_per_step * r.samples_per_prompt, prompt, response, r.max_new_tokens,
                mfu or MFU["moe" if num_experts(hf) else "dense"], bubble)


def peak_flops(cfg: RunConfig, gpu: Gpu) -> float:
    """FLOP/s of one GPU at its peak: FP8's with ``model.fp8`` where the part has it, else bf16's."""
    return (gpu.fp8_tflops if cfg.model.fp8 and gpu.fp8_tflops else gpu.peak_tflops) * 1e12


def train_time(counts: Counts, hf: dict, cfg: RunConfig, lay: Layout, gpu: Gpu, work: Work) -> dict:
    """The trainer's seconds per step, by term (the module docstring's train)."""
    h, layers, q = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"] * head_dim(hf)
    w = WEIGHT_BYTES[cfg.trainer.precision]
    ref = 1 if cfg.algo.kl_coef > 0 else 0
    s, tokens = work.prompt_tokens + work.response_tokens, work.tokens
    flops = tokens * ((6 + 2 * ref) * counts.active + (6 + 2 * ref) * layers * q * s)
    compute = flops / (lay.world * peak_flops(cfg, gpu) * work.mfu)
    again = recompute_flops(counts, hf, lay.recompute, tokens, s)
    recompute = again / (lay.world * peak_flops(cfg, gpu) * work.mfu)
    nvlink, network = gpu.nvlink_gbps * 1e9, gpu.network_gbps * 1e9
    collectives = 4 + 2 * ref + (2 if lay.recompute == "full" else 0)
    local = tokens / lay.dp_cp  # a rank's share of the step's tokens (a CP rank: 1/CP of its DP rank's)
    tp = (local * layers / lay.pp * h * w * collectives * 2 * (lay.tp - 1) / lay.tp / nvlink)
    ep = 0.0
    if lay.ep > 1:
        in_node = max(1, min(lay.ep, lay.gpus_per_node // lay.etp))
        moved = local / lay.tp * moe_layers(hf) / lay.pp * int(hf["num_experts_per_tok"]) * h * w
        ep = moved * collectives * ((in_node - 1) / lay.ep / nvlink + (lay.ep - in_node) / lay.ep / network)
    micro = max(1, math.ceil(tokens / lay.dp / microbatch_tokens(cfg)))
    p2p_link = network if lay.tp * lay.pp > lay.gpus_per_node else nvlink  # stages on other nodes
    p2p = 2 * (1 + ref) * local * h * w / p2p_link if lay.pp > 1 else 0.0
    kv = 2 * hf["num_key_value_heads"] * head_dim(hf) / lay.tp
    cp_link = network if lay.tp * lay.cp > lay.gpus_per_node else nvlink
    cp = (local * layers / lay.pp * kv * w * (2 + ref + (lay.recompute == "full")) * (lay.cp - 1) / cp_link
          if lay.cp > 1 else 0.0)
    pp = (lay.pp - 1) / (micro * lay.vpp) * (compute + recompute + tp + ep + cp) + p2p
    shared, expert = rank_params(counts, lay)
    distributed = cfg.optim.distributed_optimizer and lay.dp_cp > 1
    per_param = 4 + w if distributed else 8
    expert_dp = lay.world // (lay.pp * lay.ep * lay.etp)
    dp_bytes = per_param * (shared * (lay.dp_cp - 1) / lay.dp_cp + expert * (expert_dp - 1) / expert_dp)
    dp = dp_bytes / (network if lay.nodes > 1 else nvlink)
    shard = shared / lay.dp_cp + expert / expert_dp if distributed else shared + expert
    optimizer = shard * OPTIMIZER_TRAFFIC / (gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY)
    terms = {"compute_s": compute, "recompute_s": recompute, "tp_s": tp, "ep_s": ep, "cp_s": cp, "pp_s": pp,
             "dp_s": dp, "optimizer_s": optimizer}
    return {**terms, "total_s": sum(terms.values()), "flops": flops, "tokens": tokens, "gpus": lay.world,
            "peak_tflops": peak_flops(cfg, gpu) / 1e12, "mfu": work.mfu, "microbatches": micro,
            "reference_forward": bool(ref), "recompute": lay.recompute, "recompute_flops": again}


def recompute_flops(counts: Counts, hf: dict, recompute: str, tokens: int, s: int) -> float:
    """FLOPs ``trainer.recompute`` adds to a step of ``tokens`` trained tokens of length ``s`` (the module
    docstring's recompute): full, the layers' forward again; selective, the core attention's; none, nothing."""
    q = hf["num_attention_heads"] * head_dim(hf)
    attention = 2 * hf["num_hidden_layers"] * q * s
    if recompute == "full":
        return tokens * (2 * (counts.active - counts.embedding - counts.head) + attention)
    return tokens * attention if recompute == "selective" else 0.0


def decode_batch(hf: dict, cfg: RunConfig, lay: Layout, work: Work) -> int:
    """Sequences one replica decodes at once: min(engine.slots, its share of the step, what its KV cache holds at
    the sequences' mean full length)."""
    per_token = kv_bytes_per_token(hf, lay.engine_tp, engine_bytes(cfg, cfg.trainer.precision))
    held = int(cfg.engine.kv_cache_gib * GIB // (per_token * (work.prompt_tokens + work.response_tokens)))
    return max(1, min(cfg.engine.slots, math.ceil(work.sequences / lay.engine_replicas), held))


def rollout_time(counts: Counts, hf: dict, cfg: RunConfig, lay: Layout, gpu: Gpu, work: Work) -> dict:
    """The engines' seconds per step (the module docstring's rollout)."""
    e, we = lay.engine_tp, engine_bytes(cfg, cfg.trainer.precision)
    h, layers, q = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"] * head_dim(hf)
    b = decode_batch(hf, cfg, lay, work)
    per_replica = work.sequences / lay.engine_replicas
    dense = counts.total - counts.experts - counts.embedding  # an embedding is looked up, not read whole
    experts, moe = num_experts(hf), moe_layers(hf)
    touched = experts * (1 - (1 - int(hf.get("num_experts_per_tok") or 0) / experts) ** b) if experts else 0
    expert_size = counts.experts / (moe * experts) if experts else 0
    weight_bytes = (dense + moe * touched * expert_size) * we / e
    context = work.prompt_tokens + work.response_tokens / 2
    kv_bytes = b * context * kv_bytes_per_token(hf, e, we)
    bandwidth = gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY
    peak = peak_flops(cfg, gpu) * work.mfu
    memory_s = (weight_bytes + kv_bytes) / bandwidth
    flops_s = b * (2 * counts.active + 2 * layers * q * context) / (e * peak)
    across = e > (lay.engine_gpus or lay.gpus_per_node)  # (engine GPUs inside a node: within it)
    link, latency = ((gpu.network_gbps, NETWORK_LATENCY_S) if across else (gpu.nvlink_gbps, NVLINK_LATENCY_S))
    comm_s = 2 * layers * (latency + b * h * we * 2 * (e - 1) / e / (link * 1e9)) if e > 1 else 0.0
    step_s = max(memory_s, flops_s) + comm_s
    useful = per_replica * work.response_tokens / b
    bubble, waste = (work.bubble, 0.0) if work.bubble is not None else MODE_MEASURED.get(cfg.rollout.mode, (0, 0))
    tail = max(0, work.max_response - work.response_tokens) if cfg.rollout.mode == "sync" and work.bubble is None \
        else useful * (1 / ((1 - bubble) * (1 - waste)) - 1)
    prefill_s = per_replica * work.prompt_tokens * (2 * counts.active + 2 * layers * q * work.prompt_tokens) / (
        e * peak)
    decode_s = (useful + tail) * step_s
    # The simulator's engine step: base + per_seq × active sequences (weights and latency; KV and traffic per seq).
    per_seq_s = (kv_bytes / b) / bandwidth + (2 * layers * h * we * 2 * (e - 1) / e / (link * 1e9) if e > 1 else 0)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "total_s": prefill_s + decode_s, "replicas":
            lay.engine_replicas, "engine_tp": e, "batch": b, "decode_step_s": step_s, "weight_bytes": weight_bytes,
            "kv_bytes": kv_bytes, "comm_s": comm_s, "across_nodes": across, "compute_bound": flops_s > memory_s,
            "steps": useful + tail, "useful_steps": useful, "tail_steps": tail, "bubble": bubble, "waste": waste,
            "step_base_s": max(step_s - b * per_seq_s, 0.0), "step_per_seq_s": per_seq_s}


def sync_time(counts: Counts, hf: dict, cfg: RunConfig, lay: Layout, gpu: Gpu, trainer_gib: dict) -> dict:
    """Weight sync, sleep/wake and offload seconds per step (the module docstring's sync). ``trainer_gib``:
    ``memory_gib``'s parts (the gradients and optimizer state an offload moves)."""
    we = engine_bytes(cfg, cfg.trainer.precision)
    per_gpu = counts.total * we / lay.engine_tp
    if lay.colocated:
        path = "network" if lay.engine_tp > lay.gpus_per_node else "NVLink"
        moved = per_gpu
    else:  # broadcast from the trainer's senders: within the node when trainer and replicas share one node
        path, moved = "NVLink" if lay.engine_gpus and lay.nodes == 1 else "network", counts.total * we
    transfer = moved / ((gpu.network_gbps if path == "network" else gpu.nvlink_gbps) * 1e9)
    host = gpu.host_gbps * 1e9
    sleep = 2 * per_gpu / host if lay.colocated and lay.sleep_level == 1 else 0.0
    offload = 2 * (trainer_gib["gradients"] + trainer_gib["optimizer"]) * GIB / host if lay.offload else 0.0
    return {"transfer_s": transfer, "sleep_s": sleep, "offload_s": offload, "total_s": transfer + sleep + offload,
            "bytes": moved, "path": path}


def step_time(counts: Counts, hf: dict, cfg: RunConfig, lay: Layout, gpu: Gpu, work: Work, mem: dict) -> dict:
    """The step's seconds: the three terms, how they combine (``rollout.overlap``), and what bounds it."""
    train = train_time(counts, hf, cfg, lay, gpu, work)
    rollout = rollout_time(counts, hf, cfg, lay, gpu, work)
    sync = sync_time(counts, hf, cfg, lay, gpu, mem)
    overlap = not lay.colocated and cfg.rollout.overlap != "none"
    t, r, s = train["total_s"], rollout["total_s"], sync["total_s"]
    step = max(t, r) + s if overlap else t + r + s
    bound = max((t, "training-bound"), (r, "rollout-bound"), (s, "sync-bound"))[1]
    return {"step_s": step, "train_s": t, "rollout_s": r, "sync_s": s, "bound": bound, "overlap": overlap,
            "train": train, "rollout": rollout, "sync": sync, "train_s_per_token": t / work.tokens,
            "work": {"sequences": work.sequences, "prompt_tokens": work.prompt_tokens,
                     "response_tokens": work.response_tokens, "max_response": work.max_response}}


def step_line(st: dict) -> str:
    """'step time  12.3 s/step (train 7.1 s, rollout 9.8 s, sync 0.6 s; rollout-bound)' (scripts read it)."""
    return (f"step time {st['step_s']:5.1f} s/step (train {st['train_s']:.1f} s, rollout {st['rollout_s']:.1f} s, "
            f"sync {st['sync_s']:.1f} s; {st['bound']})")

