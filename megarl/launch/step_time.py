"""Seconds per RL step of a layout: training, rollout and weight sync, each from the model's shape, the batch and
the GPU's figures (``gpus.Gpu``), at the named efficiencies of ``efficiency.py``. Pure arithmetic; every term keeps
the inputs it was computed from. Training is here; the rollout and the sync are in ``rollout_time.py``.

    train    = compute + recompute + TP + EP + CP + PP bubble + DP + optimizer + reference swap
      passes    what a step runs over its T trained tokens (sequences × (prompt + response)): the policy's forward
                and backward ``algo.ppo_epochs`` times, forwards alone for the reference model (algo.kl_coef > 0),
                the proximal policy (algo.tis, algo.decoupled_ppo as resolved) and R2's route recording
                (algo.routing_replay trainer, which also gives the proximal logprobs), and with
                ``algo.advantage: gae`` the critic's forward and its ppo_epochs forwards and backwards;
                ppo_epochs × algo.minibatches optimizer steps a learner
      compute   FLOPs / (trainer GPUs × peak × MFU); a forward is T × (2·N + 2·L·q·s), N the active parameters
                that multiply (the input embedding is a lookup: not counted; the output head is), s the sequences'
                length, q the attention width (QKᵀ and AV, halved by the causal mask), a backward twice that (LoRA:
                the frozen base's weight gradients skipped, T × (2·N + 4·L·q·s), the adapters' negligible); the
                expert GEMMs' share (2·N_experts_active a token) runs at MFU × their efficiency at the step's
                tokens per expert (``efficiency.expert_gemm_efficiency``: grouped under Transformer Engine, one GEMM
                per expert without)
      recompute trainer.recompute full: the layers' forward once more in each backward, T × (2·N_layers + 2·L·q·s)
                (N_layers: N less the output head; ~+33% of the compute), and its TP all-reduces and EP all-to-alls;
                selective: the core attention's forward, T × 2·L·q·s
      TP        per GPU: (T/DP) · (L/PP) · h · w · 2 all-reduces per forward and per backward pass ·
                2(TP−1)/TP bytes over NVLink
      EP        per GPU: T/(DP·TP) tokens · (L_moe/PP) · topk · h · w · 2 all-to-alls (dispatch and combine) per
                forward and backward pass, the share (EP−1)/EP leaving the GPU: over NVLink to peers in the node,
                the network to the others
      CP        parallel.cp: per GPU and pass, the keys and values of the other CP ranks' positions, each layer's
                all-gathered in a forward and their gradients reduce-scattered in a backward (Transformer Engine's
                p2p ring moves as many): (T/(DP·CP)) · (L/PP) · 2·kv/TP · w · (CP−1) bytes over NVLink, the network
                when TP·CP spans nodes; T/(DP·CP) stands for T/DP in TP, EP and the PP activations (a CP rank holds
                1/CP of a micro-batch), and DP is DP × CP
      PP        the 1F1B bubble, (PP−1) / (micro-batches of an optimizer step · VPP) × (compute + recompute + TP +
                EP + CP), + the activations between stages, (T/DP) · h · w a pass, over NVLink, the network when
                TP·PP spans nodes
      DP        per GPU and optimizer step: parameters · (4 B reduce-scatter of fp32 gradients + w all-gather of
                weights) · (DP−1)/DP under the distributed optimizer (2 · 4 B all-reduce without); experts over the
                expert data-parallel group; over the network when the job has several nodes, else NVLink
      optimizer per optimizer step, Adam's read and write of ~32 B per parameter of the rank's shard at HBM bandwidth
      reference swap  trainer.reference_on_host with a KL reference: 3 copies of the rank's weights over the host
                link a step (the policy's out, the reference's in, the policy's back)
    step     = train + rollout + sync (colocated, or rollout.overlap none); rollout.overlap one_step / async with
               disaggregated engines: max(train, rollout) + sync
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.config.schema import RunConfig
from megarl.config.validate.algo import reference_kept, resolved_decoupled_ppo
from megarl.config.validate.lora import lora_on_experts
from megarl.config.validate.settings import transformer_engine_planned
from megarl.launch.efficiency import HBM_EFFICIENCY, MFU, SMS, expert_gemm_efficiency
from megarl.launch.gpus import Gpu
from megarl.launch.layout import Layout
from megarl.launch.memory import WEIGHT_BYTES, microbatch_tokens, rank_params
from megarl.launch.model_size import Counts, head_dim, moe_layers
from megarl.models.hf_config import num_experts

__all__ = ["HBM_EFFICIENCY", "MFU", "Work", "passes_of", "step_line", "step_time", "train_time", "work_of"]

OPTIMIZER_TRAFFIC = 32
"""Bytes Adam reads and writes per parameter of its shard (fp32 weight, gradient, m, v in; weight, m, v, bf16 out)."""
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


def multiplying_params(counts: Counts, hf: dict) -> int:
    """Active parameters a token's forward multiplies by: all but the input embedding (a lookup), the output head
    counted as a GEMM of vocab × h even when tied to the embedding."""
    return counts.in_layers + hf["vocab_size"] * hf["hidden_size"]


def passes_of(cfg: RunConfig, hf: dict) -> dict:
    """What one step runs over its batch (the module docstring's passes): the policy's training epochs, its
    forward-only passes by name, whether a critic trains, each learner's optimizer steps."""
    a = cfg.algo
    r2 = a.routing_replay == "trainer" and bool(num_experts(hf))
    forwards = {"reference": a.kl_coef > 0, "routes (R2)": r2,
                "proximal": not r2 and (a.tis != "none" or resolved_decoupled_ppo(cfg))}
    return {"epochs": a.ppo_epochs, "forwards": [name for name, on in forwards.items() if on],
            "critic": a.advantage == "gae", "optimizer_steps": a.ppo_epochs * a.minibatches}


def tokens_per_expert(hf: dict, cfg: RunConfig, lay: Layout, tokens: int) -> float:
    """Tokens one local expert's GEMMs take per micro-batch: a micro-batch's tokens on a rank (1/(TP·CP) of it,
    gathered over expert TP) × topk, from the EP ranks, over the experts."""
    experts = num_experts(hf)
    micro = min(microbatch_tokens(cfg), tokens / lay.dp)
    return micro / (lay.tp * lay.cp) * lay.etp * int(hf["num_experts_per_tok"]) * lay.ep / experts


def train_time(counts: Counts, hf: dict, cfg: RunConfig, lay: Layout, gpu: Gpu, work: Work) -> dict:
    """The trainer's seconds per step, by term (the module docstring's train)."""
    h, layers, q = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"] * head_dim(hf)
    w = WEIGHT_BYTES[cfg.trainer.precision]
    p = passes_of(cfg, hf)
    epochs, extra, critic = p["epochs"], len(p["forwards"]), p["critic"]
    s, tokens = work.prompt_tokens + work.response_tokens, work.tokens
    head = 2 * hf["vocab_size"] * h  # the output head's FLOPs a token (the critic's value head: 2·h)
    forward = 2 * multiplying_params(counts, hf) + 2 * layers * q * s  # a token's forward
    expert_fwd = 2 * counts.experts_active
    # a backward is two forwards (input and weight gradients); LoRA's skips the frozen base's weight gradients
    lora = cfg.lora.rank > 0
    backward = forward + 2 * layers * q * s if lora else 2 * forward
    # forward-equivalents of the policy's parameter FLOPs and of the critic's (its head a value)
    policy_units, critic_units = epochs * (2 if lora else 3) + extra, (1 + 3 * epochs) if critic else 0
    flops = tokens * (epochs * (forward + backward) + extra * forward + critic_units * (forward - head + 2 * h))
    backwards = epochs * (1 + critic)
    again = recompute_flops(counts, hf, lay.recompute, tokens, s) * backwards
    peak = peak_flops(cfg, gpu)
    efficiency, per_expert = 1.0, 0.0
    # Transformer Engine's grouped expert GEMMs (LoRA on the experts: one GEMM per expert, SequentialMLP)
    grouped = transformer_engine_planned(cfg, True) and not lora_on_experts(cfg.lora)
    if num_experts(hf):
        per_expert = tokens_per_expert(hf, cfg, lay, tokens)
        efficiency = expert_gemm_efficiency(
            hf, per_expert, num_experts(hf) // lay.ep, lay.etp, peak * MFU["dense"],
            gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY, SMS.get(gpu.name, 132),
            grouped=grouped)
    experts_in = tokens * expert_fwd * (policy_units + critic_units)  # the expert GEMMs' FLOPs among them
    experts_again = tokens * expert_fwd * backwards if lay.recompute == "full" else 0
    rate = lay.world * peak * work.mfu
    compute = (flops - experts_in + experts_in / efficiency) / rate
    recompute = (again - experts_again + experts_again / efficiency) / rate
    nvlink, network = gpu.nvlink_gbps * 1e9, gpu.network_gbps * 1e9
    forwards = epochs + extra + (1 + epochs if critic else 0)
    passes = forwards + backwards + (backwards if lay.recompute == "full" else 0)
    collectives = 2 * passes
    local = tokens / lay.dp_cp  # a rank's share of the step's tokens (a CP rank: 1/CP of its DP rank's)
    tp = (local * layers / lay.pp * h * w * collectives * 2 * (lay.tp - 1) / lay.tp / nvlink)
    ep = 0.0
    if lay.ep > 1:
        in_node = max(1, min(lay.ep, lay.gpus_per_node // lay.etp))
        moved = local / lay.tp * moe_layers(hf) / lay.pp * int(hf["num_experts_per_tok"]) * h * w
        ep = moved * collectives * ((in_node - 1) / lay.ep / nvlink + (lay.ep - in_node) / lay.ep / network)
    steps = p["optimizer_steps"]
    micro = max(1, math.ceil(tokens / lay.dp / steps / microbatch_tokens(cfg)))  # an optimizer step's
    p2p_link = network if lay.tp * lay.pp > lay.gpus_per_node else nvlink  # stages on other nodes
    p2p = (forwards + backwards) * local * h * w / p2p_link if lay.pp > 1 else 0.0
    kv = 2 * hf["num_key_value_heads"] * head_dim(hf) / lay.tp
    cp_link = network if lay.tp * lay.cp > lay.gpus_per_node else nvlink
    cp = (local * layers / lay.pp * kv * w * passes * (lay.cp - 1) / cp_link if lay.cp > 1 else 0.0)
    pp = (lay.pp - 1) / (micro * lay.vpp) * (compute + recompute + tp + ep + cp) + p2p
    shared, expert = rank_params(counts, lay)
    distributed = cfg.optim.distributed_optimizer and lay.dp_cp > 1
    per_param = 4 + w if distributed else 8
    expert_dp = lay.world // (lay.pp * lay.ep * lay.etp)
    learners = steps * (1 + critic)  # optimizer steps of the step, the critic's included
    dp_bytes = per_param * (shared * (lay.dp_cp - 1) / lay.dp_cp + expert * (expert_dp - 1) / expert_dp)
    dp = learners * dp_bytes / (network if lay.nodes > 1 else nvlink)
    shard = shared / lay.dp_cp + expert / expert_dp if distributed else shared + expert
    optimizer = learners * shard * OPTIMIZER_TRAFFIC / (gpu.hbm_tbps * 1e12 * HBM_EFFICIENCY)
    # trainer.reference_on_host: the policy's weights to the host, the reference's in, the policy's back (a step's)
    swap = 3 * (shared + expert) * w / (gpu.host_gbps * 1e9) if reference_kept(cfg) == "host" else 0.0
    terms = {"compute_s": compute, "recompute_s": recompute, "tp_s": tp, "ep_s": ep, "cp_s": cp, "pp_s": pp,
             "dp_s": dp, "optimizer_s": optimizer, "reference_swap_s": swap}
    return {**terms, "total_s": sum(terms.values()), "flops": flops, "tokens": tokens, "gpus": lay.world,
            "peak_tflops": peak / 1e12, "mfu": work.mfu, "microbatches": micro,
            "reference_forward": "reference" in p["forwards"], "passes": p, "recompute": lay.recompute,
            "recompute_flops": again, "tokens_per_expert": per_expert, "expert_efficiency": efficiency,
            "grouped_gemm": grouped}


def recompute_flops(counts: Counts, hf: dict, recompute: str, tokens: int, s: int) -> float:
    """FLOPs ``trainer.recompute`` adds to one backward over ``tokens`` trained tokens of length ``s`` (the module
    docstring's recompute): full, the layers' forward again; selective, the core attention's; none, nothing."""
    q = hf["num_attention_heads"] * head_dim(hf)
    attention = 2 * hf["num_hidden_layers"] * q * s
    if recompute == "full":
        return tokens * (2 * counts.in_layers + attention)
    return tokens * attention if recompute == "selective" else 0.0


def step_time(counts: Counts, hf: dict, cfg: RunConfig, lay: Layout, gpu: Gpu, work: Work, mem: dict) -> dict:
    """The step's seconds: the three terms, how they combine (``rollout.overlap``), and what bounds it. ``mem``:
    ``memory_gib``'s parts (the KV cache the engine reserves, the state an offload moves)."""
    from megarl.launch.rollout_time import rollout_time, sync_time

    train = train_time(counts, hf, cfg, lay, gpu, work)
    rollout = rollout_time(counts, hf, cfg, lay, gpu, work, mem.get("kv_cache"))
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
