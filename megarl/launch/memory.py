"""Memory per GPU of a layout: the trainer's worst pipeline stage and the vLLM engine's share, by phase.

- weights P·w, gradients P·4 (fp32 main grads), optimizer state (fp32: Adam m, v = 8 B;
  bf16: + fp32 main weights = 12 B), divided by DP under the distributed optimizer (expert
  parameters by the expert data-parallel size). P = this rank's parameters:
  (attention + dense MLPs)/(TP·PP) + experts/(PP·EP·ETP) + embedding (and head if PP = 1)/TP. With LoRA
  (``lora.rank`` > 0) the base P is frozen (weights only) and the adapters (the PP stage's share,
  ``model_size.adapter_params``) take the weights' bytes, the gradients and the optimizer state.
- activations (``trainer.recompute`` none): per layer and token, w·(2h + 2·q + 2·kv) for attention, plus the core
  attention's own (``core_attention_floats``: none for fused attention — Transformer Engine's, or megarl's packed
  rows through SDPA's kernels —, 2·heads·s for megatron's unfused attention of padded rows), w·(h + 3f) for a dense
  MLP and w·(h + topk·(h + 3f_e) + h + 3f_s) for MoE, divided by TP (without sequence parallelism the
  norms' 3h stay whole), times the tokens of a micro-batch — ``trainer.max_tokens_per_microbatch`` when packed
  micro-batches are balanced by tokens (at most that many each), else micro_batch_size · max_model_len —, times
  all layers (1F1B keeps PP microbatches of L/PP layers; interleaving adds (PP−1)/(PP·VPP)). Selective recompute
  drops the core attention's own; full recompute keeps only each unit's input, w·h per ``trainer.recompute_layers``
  layers (times the micro-batches in flight, as above), plus one unit's working set: its layers' activations as
  without recompute, once (the backward recomputes one unit at a time).
- logits: logprob_chunk (or all) positions × vocab/TP × 4 B × 2 (values and gradient).
- the other learners (``config.validate.algo.needed_learners``): a frozen KL reference, P·w (no gradients, no
  optimizer; with LoRA none: the policy's base with its adapters off; ``trainer.reference_on_host`` none: host
  memory); a GAE critic, a whole model of its own (P·w + P·4 + its optimizer state, LoRA or not).
- context parallelism (``parallel.cp``): a rank holds 1/CP of a micro-batch's positions, so its activations and
  (unchunked) logits are 1/CP; where keys and values are all-gathered (the CPU path, ``parallel.cp_comm_type``
  all_gather) each layer also keeps the other ranks' (CP−1)/CP of them for the backward: 2·KV heads/TP·head dim·w a
  token and layer (``gathered_kv_bytes``).
- vLLM: all weights · w / engine TP; KV cache: ``engine.kv_cache_gib`` per GPU, what each engine worker reserves
  (vLLM's ``kv_cache_memory_bytes``), or with ``engine.gpu_memory_utilization`` what that share of the GPU leaves
  after the engine's weights and CUDA graphs; CUDA graphs (``engine.enforce_eager`` auto or false on GPUs): an
  estimate of vLLM's pool (``cuda_graph_gib``). Plus 2 GiB runtime overhead.

The total is the peak of the phases: colocated at sleep level 0, everything at once; at level 1 or 2 the larger of
training (the trainer alone: the engine asleep) and generation (the policy's and critic's weights; their gradients
and optimizer state and the reference unless ``trainer.offload_during_rollout``; the engine); disaggregated, the
larger of a trainer GPU and an engine GPU.
"""

from __future__ import annotations

from megarl.config import ConfigError
from megarl.config.schema import RunConfig
from megarl.config.validate.algo import needed_learners, reference_kept
from megarl.config.validate.settings import transformer_engine_planned
from megarl.launch.layout import Layout
from megarl.launch.model_size import Counts, adapter_params, head_dim
from megarl.models.hf_config import is_moe_layer, num_experts

GIB = 1024**3
OVERHEAD_GIB = 2.0
"""CUDA context, NCCL buffers and allocator slack per GPU."""
OPTIMIZER_BYTES = {"fp32": 8, "bf16": 12}
WEIGHT_BYTES = {"fp32": 4, "bf16": 2}
ENGINE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TRAINER_PARTS = ("weights", "gradients", "optimizer", "activations", "logits", "reference", "critic")


def engine_bytes(cfg: RunConfig, precision: str) -> int:
    """Bytes of one engine weight or KV value: ``engine.dtype`` ('auto': the trainer's ``precision``)."""
    return ENGINE_BYTES[cfg.engine.dtype] if cfg.engine.dtype != "auto" else WEIGHT_BYTES[precision]


def bytes_per_param(cfg: RunConfig, precision: str) -> dict:
    """What the plan assumes each parameter costs: the trainer's weights, fp32 gradients, the optimizer's state
    (Adam m, v; bf16 adds the fp32 main weights) before the distributed optimizer divides it, the engine's copy."""
    return {"weights": WEIGHT_BYTES[precision], "gradients": 4, "optimizer": OPTIMIZER_BYTES[precision],
            "engine": engine_bytes(cfg, precision)}


def rank_params(counts: Counts, lay: Layout) -> tuple[float, float]:
    """One trainer rank's parameters of its worst stage: (shared by TP, routed experts)."""
    emb = counts.embedding + counts.head if lay.pp == 1 else max(counts.embedding, counts.head)
    shared = (counts.attention + counts.dense) / (lay.tp * lay.pp) + emb / lay.tp
    return shared, counts.experts / (lay.pp * lay.ep * lay.etp)


def activation_floats(hf: dict) -> int:
    """Floats one token keeps per layer summed over the layers (the module docstring's activations), whole."""
    h = hf["hidden_size"]
    q, kv = hf["num_attention_heads"] * head_dim(hf), hf["num_key_value_heads"] * head_dim(hf)
    topk = int(hf.get("num_experts_per_tok") or 0)
    f_e = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
    f_s = int(hf.get("shared_expert_intermediate_size") or 0)
    per_token = 0
    for layer in range(hf["num_hidden_layers"]):
        per_token += 2 * h + 2 * q + 2 * kv
        if is_moe_layer(hf, layer):
            per_token += h + topk * (h + 3 * f_e) + (h + 3 * f_s if f_s else 0)
        else:
            per_token += h + 3 * hf["intermediate_size"]
    return per_token


def core_attention_floats(hf: dict, cfg: RunConfig, cpu: bool = False) -> int:
    """Floats per token and layer the core attention keeps of its own, beyond its inputs q, k, v and its output
    (which ``activation_floats`` counts): what selective recompute drops. Fused attention keeps only its softmax
    statistics, none here: Transformer Engine's (``model.transformer_engine`` true, or auto on GPUs without LoRA)
    and megarl's packed rows through SDPA's kernels (``trainer.packing``). megatron's unfused local attention over
    padded rows keeps the scores and their softmax, heads × s each per token (s: ``engine.max_model_len``)."""
    if transformer_engine_planned(cfg, not cpu) or cfg.trainer.packing:
        return 0
    return 2 * hf["num_attention_heads"] * cfg.engine.max_model_len


def recompute_activation_floats(hf: dict, recompute: str, unit_layers: int = 1, core: int = 0) -> dict:
    """Floats per token of a micro-batch under ``recompute`` (``trainer.recompute``), whole (before TP), as two
    parts: ``kept`` (held for the backward by every micro-batch in flight) and ``unit`` (one recompute unit's
    working set, once). ``core``: ``core_attention_floats``."""
    layers = hf["num_hidden_layers"]
    whole = activation_floats(hf) + layers * core
    if recompute == "none":
        return {"kept": whole, "unit": 0}
    if recompute == "selective":
        return {"kept": whole - layers * core, "unit": 0}
    return {"kept": layers // unit_layers * hf["hidden_size"], "unit": whole * unit_layers / layers}


def cuda_graph_gib(hf: dict, cfg: RunConfig, lay: Layout, precision: str, cpu: bool = False) -> float:
    """vLLM's CUDA graphs on each engine GPU (``engine.enforce_eager`` auto or false; none on CPU), an estimate: the
    captured decode batches share one memory pool that their largest fills, min(2 · ``engine.slots``, 512) tokens
    (vLLM's largest capture size) of transient activations per token: hidden state and residual (2h), q, k, v and
    the attention output (2q + 2kv), the widest MLP (2f, or topk · 2f_e for MoE), over engine TP in the engine's
    dtype, plus the fp32 logits (vocab / engine TP · 4 B). vLLM logs its own figure at start ("CUDA graph pool
    memory")."""
    if cpu or cfg.engine.enforce_eager is True:
        return 0.0
    tokens = min(2 * cfg.engine.slots, 512)
    q, kv = hf["num_attention_heads"] * head_dim(hf), hf["num_key_value_heads"] * head_dim(hf)
    topk = int(hf.get("num_experts_per_tok") or 0)
    mlp = max(2 * hf["intermediate_size"], topk * 2 * int(hf.get("moe_intermediate_size") or 0))
    per_token = (2 * hf["hidden_size"] + 2 * q + 2 * kv + mlp) * engine_bytes(cfg, precision)
    return tokens * (per_token + hf["vocab_size"] * 4) / lay.engine_tp / GIB


def engine_reserved_gib(cfg: RunConfig, weights_gib: float, graphs_gib: float, gpu_mem_gib: float) -> float:
    """The KV cache vLLM reserves on each engine GPU: ``engine.kv_cache_gib`` (``kv_cache_memory_bytes``, CUDA graphs
    on top); with ``engine.gpu_memory_utilization`` what that share of the GPU leaves after the engine's weights and
    CUDA graphs (vLLM sizes it so; the engine then holds that share in all)."""
    share = cfg.engine.gpu_memory_utilization
    if not share:
        return cfg.engine.kv_cache_gib
    return max(0.0, share * gpu_mem_gib - weights_gib - graphs_gib)


def memory_gib(counts: Counts, hf: dict, cfg: RunConfig, lay: Layout, precision: str = "fp32",
               cpu: bool = False, gpu_mem_gib: float = 0.0) -> dict:
    """Memory per GPU (``cpu``: per process, no CUDA runtime) in GiB, by part (see the module docstring);
    ``gpu_mem_gib``: the GPU's, which ``engine.gpu_memory_utilization`` takes a share of."""
    w = WEIGHT_BYTES[precision]
    h, layers = hf["hidden_size"], hf["num_hidden_layers"]
    shared, expert = rank_params(counts, lay)
    params = shared + expert
    expert_dp = lay.world // (lay.pp * lay.ep * lay.etp)
    distributed = cfg.optim.distributed_optimizer and lay.dp_cp > 1
    adapters = adapter_params(hf, cfg, lay.tp, lay.ep, lay.etp) / lay.pp  # LoRA: the base frozen, only these train
    whole_opt = (shared / lay.dp_cp + expert / expert_dp if distributed else params) * OPTIMIZER_BYTES[precision]
    if adapters:
        trained, opt_full = adapters, adapters * OPTIMIZER_BYTES[precision]
        opt = opt_full / lay.dp_cp if distributed else opt_full
    else:
        trained, opt_full = params, params * OPTIMIZER_BYTES[precision]
        opt = whole_opt
    critic = "critic" in needed_learners(cfg.algo, cfg.lora.rank)
    critic_state = params * 4 + whole_opt if critic else 0.0  # its gradients and optimizer state
    # Without sequence parallelism the norms' inputs and outputs (3h per layer) are whole on every TP rank.
    replicated = 3 * h * layers if lay.tp > 1 and not lay.sequence_parallel else 0
    tokens = microbatch_tokens(cfg) / lay.cp  # a CP rank's share of a micro-batch's positions
    inflight = 1 + (lay.pp - 1) / (lay.pp * lay.vpp) if lay.vpp > 1 else 1.0
    core = core_attention_floats(hf, cfg, cpu)
    by_mode = {}
    for mode in ("none", "selective", "full"):
        part = recompute_activation_floats(hf, mode, lay.recompute_layers, core)
        whole = part["kept"] * inflight + part["unit"]
        # whole on every TP rank without SP: the norms' inputs (under full recompute a unit's), the kept layer inputs
        rest = replicated * inflight if mode != "full" else (
            replicated * lay.recompute_layers / layers + (part["kept"] * inflight if replicated else 0))
        by_mode[mode] = ((whole - rest) / lay.tp + rest) * tokens * w
    act = by_mode[lay.recompute] + gathered_kv_bytes(hf, cfg, lay, precision, cpu)
    chunk = min(cfg.optim.logprob_chunk or tokens, tokens)
    logits = chunk * hf["vocab_size"] / lay.tp * 4 * 2

    parts = {
        "weights": (params + adapters) * w / GIB,
        "gradients": trained * 4 / GIB,
        "optimizer": opt / GIB,
        "activations": act / GIB,
        "logits": logits / GIB,
        "reference": params * w / GIB if reference_kept(cfg) == "device" else 0.0,
        "critic": (params * w + critic_state) / GIB if critic_state else 0.0,
        "critic_state": critic_state / GIB,
        "engine_weights": counts.total * engine_bytes(cfg, precision) / lay.engine_tp / GIB,
        "cuda_graphs": cuda_graph_gib(hf, cfg, lay, precision, cpu),
        "overhead": 0.0 if cpu else OVERHEAD_GIB,
    }
    # reserved whatever the rollout needs (kv_cache_memory_bytes), or the rest of engine.gpu_memory_utilization
    parts["kv_cache"] = engine_reserved_gib(cfg, parts["engine_weights"], parts["cuda_graphs"], gpu_mem_gib)
    kv = kv_cache_use(hf, cfg, lay, precision, parts["kv_cache"])
    parts["total"], parts["peak"] = peak_of(parts, lay)
    parts["optimizer_without_distributed"] = opt_full / GIB
    parts["activations_full_recompute"] = by_mode["full"] / GIB
    parts["activations_by_recompute"] = {mode: v / GIB for mode, v in by_mode.items()}
    parts["kv_cache_needed"] = kv["needed"] / GIB
    parts["kv_cache_sequences"] = kv["sequences"]
    parts["kv_cache_sequences_held"] = kv["held"]
    return parts


def gathered_kv_bytes(hf: dict, cfg: RunConfig, lay: Layout, precision: str, cpu: bool = False) -> float:
    """The other CP ranks' keys and values a rank keeps for the backward where they are all-gathered (the CPU path,
    or ``parallel.cp_comm_type`` all_gather on GPUs; TE's ring passes them on): its stage's layers, a micro-batch."""
    if lay.cp == 1 or not (cpu or cfg.parallel.cp_comm_type == "all_gather"):
        return 0.0
    per_token = kv_bytes_per_token(hf, lay.tp, WEIGHT_BYTES[precision]) / lay.pp
    return per_token * microbatch_tokens(cfg) * (lay.cp - 1) / lay.cp


def peak_of(parts: dict, lay: Layout) -> tuple[float, str]:
    """The largest of the phases' sums and its name (the module docstring's last paragraph)."""
    trainer = sum(parts[k] for k in TRAINER_PARTS) + parts["overhead"]
    engine = parts["engine_weights"] + parts["cuda_graphs"] + parts["kv_cache"]
    if not lay.colocated:
        return max((trainer, "on a trainer GPU"), (engine + parts["overhead"], "on an engine GPU"))
    if lay.sleep_level == 0:
        return trainer + engine, "training and generation at once"
    held = parts["weights"] + parts["critic"] - parts["critic_state"] + (0.0 if lay.offload else offloaded(parts))
    return max((trainer, "while training"), (held + engine + parts["overhead"], "while generating"))


def offloaded(parts: dict) -> float:
    """GiB ``trainer.offload_during_rollout`` moves to host while the engines generate (``memory_gib``'s parts): the
    policy's and the critic's gradients and optimizer state, a frozen reference's weights."""
    return parts["gradients"] + parts["optimizer"] + parts["critic_state"] + parts["reference"]


def microbatch_tokens(cfg: RunConfig) -> int:
    """The tokens of one trainer micro-batch activations are sized at: ``trainer.max_tokens_per_microbatch`` (a
    packed micro-batch holds at most that many, padding aside), else ``optim.micro_batch_size`` rows of
    ``engine.max_model_len`` (the worst case, packed or padded)."""
    t = cfg.trainer
    if t.packing and t.max_tokens_per_microbatch:
        return t.max_tokens_per_microbatch
    return cfg.optim.micro_batch_size * cfg.engine.max_model_len


def kv_bytes_per_token(hf: dict, engine_tp: int, value_bytes: int) -> int:
    """KV cache bytes of one token on one engine GPU: 2 (k, v) · layers · KV heads on the rank · head dim · w."""
    kv_heads = -(-hf["num_key_value_heads"] // engine_tp)
    return 2 * hf["num_hidden_layers"] * kv_heads * head_dim(hf) * value_bytes


def rollout_sequences(cfg: RunConfig) -> int:
    """The sequences the rollout runs in a step: prompts × samples (× oversubscription outside sync mode)."""
    r = cfg.rollout
    return int(r.prompts_per_step * r.samples_per_prompt * (r.oversubscription if r.mode != "sync" else 1))


def kv_cache_use(hf: dict, cfg: RunConfig, lay: Layout, precision: str = "fp32",
                 reserved_gib: float | None = None) -> dict:
    """The rollout's KV cache per GPU against what the engine reserves (``reserved_gib``, default
    ``engine.kv_cache_gib``): bytes per token on one engine GPU, the sequences the rollout runs at once (min(slots,
    rollout sequences)), the bytes they need at ``engine.max_model_len``, and how many of them the cache holds at
    once."""
    concurrent = min(cfg.engine.slots, rollout_sequences(cfg))
    per_token = kv_bytes_per_token(hf, lay.engine_tp, engine_bytes(cfg, precision))
    per_sequence = cfg.engine.max_model_len * per_token
    reserved = cfg.engine.kv_cache_gib if reserved_gib is None else reserved_gib
    held = min(concurrent, int(reserved * GIB // per_sequence))
    return {"per_token": per_token, "per_sequence": per_sequence, "sequences": concurrent,
            "needed": concurrent * per_sequence, "held": held}


def check_kv_cache(hf: dict, cfg: RunConfig, lay: Layout, precision: str = "fp32") -> None:
    """ConfigError when ``engine.kv_cache_gib`` cannot hold one sequence of ``engine.max_model_len``: vLLM
    refuses to start such an engine ("to serve at least one request with the model's max seq len ..."). With
    ``engine.gpu_memory_utilization`` the share sizes the cache instead (the memory table's kv_cache line)."""
    if cfg.engine.gpu_memory_utilization:
        return
    kv = kv_cache_use(hf, cfg, lay, precision)
    if kv["held"] < 1:
        e = cfg.engine
        raise ConfigError(f"engine.kv_cache_gib={e.kv_cache_gib:g} cannot hold one sequence of engine.max_model_len="
                          f"{e.max_model_len} ({kv['per_sequence'] / GIB:.3g} GiB per GPU at engine TP "
                          f"{lay.engine_tp}, {precision}): vLLM would refuse to start; valid: engine.kv_cache_gib >= "
                          f"{kv['per_sequence'] / GIB:.3g} (the rollout's {kv['sequences']} sequences at once: "
                          f"{kv['needed'] / GIB:.3g}), or a shorter engine.max_model_len")


def route_bytes(hf: dict, cfg: RunConfig) -> dict:
    """What the routes of an MoE rollout add (``engines.routes``: each token's experts in every MoE layer, 1 byte an
    id under 255 experts, else 2), per token and for a step's batch at ``engine.max_model_len``; host memory of the
    samples and the trainer's batch, not GPU memory. {} for a dense model."""
    experts = num_experts(hf)
    if not experts:
        return {}
    layers = sum(is_moe_layer(hf, i) for i in range(hf["num_hidden_layers"]))
    per_token = layers * hf["num_experts_per_tok"] * (1 if experts < 255 else 2)
    sequences = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    return {"bytes_per_token": per_token, "sequences": sequences,
            "gib_per_step": per_token * sequences * cfg.engine.max_model_len / GIB}


def route_bytes_per_rank(routes: dict, lay: Layout, packing: bool = True) -> dict:
    """``routes`` (``route_bytes``) with what one trainer rank holds of a step's (trainer/route_store.py): of the
    trainer's batch its own share, its DP rows, its pipeline stage's layers and, under sequence parallelism without
    ``trainer.packing``, its sequence chunk (``gib_per_rank_held``); during a pass the rows that pass gives it, as
    many again (``gib_per_rank_pass``): ``gib_per_rank``. Rank 0 alone also keeps the rollout's samples with their
    routes (the leader shares samples without them, colocated replicas gather them to rank 0), from which it sends
    each rank its share: ``gib_rank_0``."""
    if not routes:
        return routes
    share = lay.dp * lay.pp * (lay.tp if lay.sequence_parallel and not packing else 1)
    held = routes["gib_per_step"] / share
    return {**routes, "gib_per_rank_held": held, "gib_per_rank_pass": held, "gib_per_rank": 2 * held,
            "gib_rank_0": routes["gib_per_step"] + 2 * held}
