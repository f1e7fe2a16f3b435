"""``megarl plan``: parameter counts from an HF config alone, memory per GPU of a layout, a proposal.

    megarl plan --model examples/models/qwen3-30b-a3b.json --nodes 2 --gpus-per-node 8 [--gpu-mem-gib 80]
                [--config FILE] [key=value ...] [--json]

``--model`` is a local checkpoint directory or ``config.json`` (nothing is downloaded; ``examples/models/`` holds
the shapes of the example models). Memory is sized at the config's sequence length and batch
(``engine.max_model_len``, ``optim.micro_batch_size`` or ``trainer.max_tokens_per_microbatch``, ``engine.slots``, the
rollout's sequences): without
``--config`` and those keys, the schema defaults, i.e. the tiny CPU demo's 256-token sequences; give yours with
``--config FILE`` or ``key=value``. When no layout fits, the closest is shown and the plan says what would fit.

Parameters (from ``config.json``; no weights): embedding (+ the output head unless tied),
per layer attention (q, k, v, o with Qwen2's qkv biases, Qwen3's q/k norms) and two norms,
and either a dense SwiGLU MLP (3·h·f) or an MoE block: router (h·E), E routed experts
(3·h·f_e each, ``topk`` of them active), a shared expert and its gate (Qwen2-MoE).
``mlp_only_layers`` / ``decoder_sparse_step`` make layers dense.

Memory per GPU, the trainer's worst pipeline stage plus the colocated vLLM engine:

- weights P·w, gradients P·4 (fp32 main grads), optimizer state (fp32: Adam m, v = 8 B;
  bf16: + fp32 main weights = 12 B), divided by DP under the distributed optimizer (expert
  parameters by the expert data-parallel size). P = this rank's parameters:
  (attention + dense MLPs)/(TP·PP) + experts/(PP·EP·ETP) + embedding (and head if PP = 1)/TP.
- activations (no recompute; megarl's trainer does not recompute): per layer and token,
  w·(2h + 2·q + 2·kv) for attention, w·(h + 3f) for a dense MLP and
  w·(h + topk·(h + 3f_e) + h + 3f_s) for MoE, divided by TP (without sequence parallelism the
  norms' 3h stay whole), times the tokens of a micro-batch — ``trainer.max_tokens_per_microbatch`` when packed
  micro-batches are balanced by tokens (at most that many each), else micro_batch_size · max_model_len (rows of the
  longest length, packed or not) —, times all layers (1F1B keeps PP microbatches of
  L/PP layers; interleaving adds (PP−1)/(PP·VPP)); full recompute keeps only w·h per layer.
- logits: logprob_chunk (or all) positions × vocab/TP × 4 B × 2 (values and gradient).
- vLLM: all weights · w / engine TP (TP < world: world/TP replicas, each holding the whole model);
  KV cache: ``engine.kv_cache_gib`` per GPU, what each engine worker reserves (vLLM's
  ``kv_cache_memory_bytes``, per GPU). The rollout wants min(slots, rollout sequences) × max_model_len
  tokens of 2·L·kv_heads_per_rank·head_dim·w bytes each; the plan prints that need, and how many
  sequences at max_model_len the configured cache holds at once when it is smaller (vLLM then runs
  fewer at once). A cache that cannot hold one such sequence is refused (vLLM would not start).
  Plus 2 GiB runtime overhead.

w is the trainer's ``trainer.precision`` (bf16: 2 B, megatron's mixed precision; fp32: 4 B); the engine's
weights and KV cache take ``engine.dtype``'s bytes (auto: the trainer's). The plan prints the bytes per
parameter it assumes. Exit status: 0 fits, 1 does not fit, 2 bad layout or input.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from megarl.config import ConfigError, load_config, validate
from megarl.config.schema import RunConfig
from megarl.config.validate.layout import check_job_shape, divisors
from megarl.config.validate.model import model_config
from megarl.launch.plan_table import format_table
from megarl.models.hf_config import (
    SUPPORTED_MODEL_TYPES,
    check_model_math,
    has_qk_norm,
    has_qkv_bias,
    is_moe_layer,
    num_experts,
)

GIB = 1024**3
OVERHEAD_GIB = 2.0
"""CUDA context, NCCL buffers and allocator slack per GPU."""
OPTIMIZER_BYTES = {"fp32": 8, "bf16": 12}
WEIGHT_BYTES = {"fp32": 4, "bf16": 2}
ENGINE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def engine_bytes(cfg: RunConfig, precision: str) -> int:
    """Bytes of one engine weight or KV value: ``engine.dtype`` ('auto': the trainer's ``precision``)."""
    return ENGINE_BYTES[cfg.engine.dtype] if cfg.engine.dtype != "auto" else WEIGHT_BYTES[precision]


def bytes_per_param(cfg: RunConfig, precision: str) -> dict:
    """What the plan assumes each parameter costs: the trainer's weights, fp32 gradients, the optimizer's state
    (Adam m, v; bf16 adds the fp32 main weights) before the distributed optimizer divides it, the engine's copy."""
    return {"weights": WEIGHT_BYTES[precision], "gradients": 4, "optimizer": OPTIMIZER_BYTES[precision],
            "engine": engine_bytes(cfg, precision)}


LAYOUT_KEYS = {*(f"parallel.{k}" for k in ("tp", "pp", "vpp", "ep", "etp", "sequence_parallel")),
               "engine.tensor_parallel_size"}
"""Setting any of these (file or command line) means: check this layout; none: propose one."""


@dataclass(frozen=True)
class Counts:
    """Parameters of a model by where they are sharded."""

    embedding: int
    head: int
    attention: int
    """All layers' attention blocks and layer norms (+ the final norm)."""
    dense: int
    """Dense MLPs, routers, shared experts and their gates (split by TP)."""
    experts: int
    """Routed experts of all layers (split by EP × ETP)."""
    experts_active: int
    """Routed experts a token passes through (topk per MoE layer)."""

    @property
    def total(self) -> int:
        return self.embedding + self.head + self.attention + self.dense + self.experts

    @property
    def active(self) -> int:
        return self.total - self.experts + self.experts_active


def _head_dim(hf: dict) -> int:
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def count_params(hf: dict) -> Counts:
    h, layers = hf["hidden_size"], hf["num_hidden_layers"]
    q, kv = hf["num_attention_heads"] * _head_dim(hf), hf["num_key_value_heads"] * _head_dim(hf)
    attn = 2 * h * q + 2 * h * kv + 2 * h  # q, o; k, v; two norms
    if has_qkv_bias(hf):
        attn += q + 2 * kv
    if has_qk_norm(hf):
        attn += 2 * _head_dim(hf)  # q_norm, k_norm
    experts, topk = num_experts(hf), int(hf.get("num_experts_per_tok") or 0)
    f_expert = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
    f_shared = int(hf.get("shared_expert_intermediate_size") or 0)
    dense = routed = active = 0
    for layer in range(layers):
        if is_moe_layer(hf, layer):
            dense += h * experts + (3 * h * f_shared + h if f_shared else 0)
            routed += experts * 3 * h * f_expert
            active += topk * 3 * h * f_expert
        else:
            dense += 3 * h * hf["intermediate_size"]
    embedding = hf["vocab_size"] * h
    head = 0 if hf.get("tie_word_embeddings") else embedding
    return Counts(embedding, head, attn * layers + h, dense, routed, active)


@dataclass(frozen=True)
class Layout:
    nodes: int
    gpus_per_node: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    engine_tp: int = 1

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    def overrides(self) -> list[str]:
        """The ``key=value`` settings that select this layout in ``megarl train``."""
        return [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.vpp={self.vpp}",
                f"parallel.ep={self.ep}", f"parallel.etp={self.etp}",
                f"parallel.sequence_parallel={str(self.sequence_parallel).lower()}",
                f"engine.tensor_parallel_size={self.engine_tp}"]


def layout_of(cfg: RunConfig, nodes: int, gpus_per_node: int) -> Layout:
    p = cfg.parallel
    return Layout(nodes, gpus_per_node, p.tp, p.pp, p.vpp, p.ep, p.etp or p.tp, p.sequence_parallel,
                  cfg.engine.tensor_parallel_size)


def apply_layout(cfg: RunConfig, lay: Layout) -> RunConfig:
    par = replace(cfg.parallel, tp=lay.tp, pp=lay.pp, vpp=lay.vpp, ep=lay.ep, etp=lay.etp,
                  sequence_parallel=lay.sequence_parallel)
    return replace(cfg, parallel=par, engine=replace(cfg.engine, tensor_parallel_size=lay.engine_tp))


def check_layout(cfg: RunConfig, hf: dict, nodes: int, gpus_per_node: int, here: bool = True) -> None:
    """``validate`` at the job's world size plus what only the job's shape tells (``check_job_shape``);
    ConfigError names the key. ``here``: the job runs on this machine's kind (not ``megarl plan`` on a login node)."""
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes ({nodes}) and --gpus-per-node ({gpus_per_node}) must be >= 1")
    validate(cfg, nodes * gpus_per_node, hf, here)
    check_job_shape(cfg, hf, nodes, gpus_per_node)


def memory_gib(counts: Counts, hf: dict, cfg: RunConfig, lay: Layout, precision: str = "fp32",
               cpu: bool = False) -> dict:
    """Memory per GPU (``cpu``: per process, no CUDA runtime) in GiB, by part (see the module docstring)."""
    w = WEIGHT_BYTES[precision]
    h, layers = hf["hidden_size"], hf["num_hidden_layers"]
    emb = counts.embedding + counts.head if lay.pp == 1 else max(counts.embedding, counts.head)
    shared = (counts.attention + counts.dense) / (lay.tp * lay.pp) + emb / lay.tp
    expert = counts.experts / (lay.pp * lay.ep * lay.etp)
    params = shared + expert
    expert_dp = lay.world // (lay.pp * lay.ep * lay.etp)
    opt_full = params * OPTIMIZER_BYTES[precision]
    distributed = cfg.optim.distributed_optimizer and lay.dp > 1
    opt = (shared / lay.dp + expert / expert_dp) * OPTIMIZER_BYTES[precision] if distributed else opt_full

    q, kv = hf["num_attention_heads"] * _head_dim(hf), hf["num_key_value_heads"] * _head_dim(hf)
    topk = int(hf.get("num_experts_per_tok") or 0)
    f_e = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
    f_s = int(hf.get("shared_expert_intermediate_size") or 0)
    per_token = 0
    for layer in range(layers):
        per_token += 2 * h + 2 * q + 2 * kv
        if is_moe_layer(hf, layer):
            per_token += h + topk * (h + 3 * f_e) + (h + 3 * f_s if f_s else 0)
        else:
            per_token += h + 3 * hf["intermediate_size"]
    # Without sequence parallelism the norms' inputs and outputs (3h per layer) are whole on every TP rank.
    replicated = 3 * h * layers if lay.tp > 1 and not lay.sequence_parallel else 0
    tokens = microbatch_tokens(cfg)
    inflight = 1 + (lay.pp - 1) / (lay.pp * lay.vpp) if lay.vpp > 1 else 1.0
    act = ((per_token - replicated) / lay.tp + replicated) * tokens * w * inflight
    act_recompute = layers * h * tokens * w / lay.tp * inflight
    chunk = min(cfg.optim.logprob_chunk or tokens, tokens)
    logits = chunk * hf["vocab_size"] / lay.tp * 4 * 2

    kv = kv_cache_use(hf, cfg, lay, precision)
    parts = {
        "weights": params * w / GIB,
        "gradients": params * 4 / GIB,
        "optimizer": opt / GIB,
        "activations": act / GIB,
        "logits": logits / GIB,
        "engine_weights": counts.total * engine_bytes(cfg, precision) / lay.engine_tp / GIB,
        "kv_cache": cfg.engine.kv_cache_gib,  # reserved whatever the rollout needs (kv_cache_memory_bytes)
        "overhead": 0.0 if cpu else OVERHEAD_GIB,
    }
    parts["total"] = sum(parts.values())
    parts["optimizer_without_distributed"] = opt_full / GIB
    parts["activations_full_recompute"] = act_recompute / GIB
    parts["kv_cache_needed"] = kv["needed"] / GIB
    parts["kv_cache_sequences"] = kv["sequences"]
    parts["kv_cache_sequences_held"] = kv["held"]
    return parts


def microbatch_tokens(cfg: RunConfig) -> int:
    """The tokens of one trainer micro-batch activations are sized at: ``trainer.max_tokens_per_microbatch`` (a
    packed micro-batch holds at most that many, padding aside), else ``optim.micro_batch_size`` rows of
    ``engine.max_model_len`` (the worst case, packed or padded)."""
    t = cfg.trainer
    if t.packing and t.max_tokens_per_microbatch:
        return t.max_tokens_per_microbatch
    return cfg.optim.micro_batch_size * cfg.engine.max_model_len


def kv_cache_use(hf: dict, cfg: RunConfig, lay: Layout, precision: str = "fp32") -> dict:
    """The rollout's KV cache per GPU against ``engine.kv_cache_gib``: bytes per token on one engine GPU,
    the sequences the rollout runs at once (min(slots, rollout sequences)), the bytes they need at
    ``engine.max_model_len``, and how many of them the configured cache holds at once."""
    r = cfg.rollout
    sequences = r.prompts_per_step * r.samples_per_prompt * (r.oversubscription if r.mode != "sync" else 1)
    concurrent = min(cfg.engine.slots, int(sequences))
    kv_heads = -(-hf["num_key_value_heads"] // lay.engine_tp)
    per_token = 2 * hf["num_hidden_layers"] * kv_heads * _head_dim(hf) * engine_bytes(cfg, precision)
    per_sequence = cfg.engine.max_model_len * per_token
    held = min(concurrent, int(cfg.engine.kv_cache_gib * GIB // per_sequence))
    return {"per_token": per_token, "per_sequence": per_sequence, "sequences": concurrent,
            "needed": concurrent * per_sequence, "held": held}


def check_kv_cache(hf: dict, cfg: RunConfig, lay: Layout, precision: str = "fp32") -> None:
    """ConfigError when ``engine.kv_cache_gib`` cannot hold one sequence of ``engine.max_model_len``: vLLM
    refuses to start such an engine ("to serve at least one request with the model's max seq len ...")."""
    kv = kv_cache_use(hf, cfg, lay, precision)
    if kv["held"] < 1:
        e = cfg.engine
        raise ConfigError(f"engine.kv_cache_gib={e.kv_cache_gib:g} cannot hold one sequence of engine.max_model_len="
                          f"{e.max_model_len} ({kv['per_sequence'] / GIB:.3g} GiB per GPU at engine TP "
                          f"{lay.engine_tp}, {precision}): vLLM would refuse to start; valid: engine.kv_cache_gib >= "
                          f"{kv['per_sequence'] / GIB:.3g} (the rollout's {kv['sequences']} sequences at once: "
                          f"{kv['needed'] / GIB:.3g}), or a shorter engine.max_model_len")


def candidates(hf: dict, nodes: int, gpus_per_node: int) -> list[Layout]:
    """Layouts in order of preference: smallest TP·PP, then fewer stages, more experts split, smaller engine TP."""
    world, experts = nodes * gpus_per_node, num_experts(hf)
    out = []
    for tp, pp, ep, etp_one, engine_tp in itertools.product(
            divisors(gpus_per_node), divisors(hf["num_hidden_layers"]), divisors(experts or 1),
            (True, False), divisors(world)):  # engine TP < world: world/TP colocated replicas
        if world % (tp * pp):
            continue
        if etp_one and (tp == 1 or not experts):
            continue
        out.append(Layout(nodes, gpus_per_node, tp, pp, 1, ep, 1 if etp_one else tp, tp > 1, engine_tp))
    out.sort(key=lambda x: (x.tp * x.pp, x.pp, -x.ep, x.etp, x.engine_tp))
    return out


def plan(hf: dict, cfg: RunConfig, nodes: int, gpus_per_node: int, gpu_mem_gib: float,
         propose: bool = False, precision: str = "", cpu: bool = False) -> dict:
    """Counts, layout and memory: of the config's layout (ConfigError if impossible), or with
    ``propose`` of the first valid layout that fits (else the one closest to fitting). Checked for the cluster,
    not for this machine (a login node's vLLM build does not say which attention head sizes the GPUs run).
    ``precision``: the trainer's to size ('': the config's ``trainer.precision``)."""
    precision = precision or cfg.trainer.precision
    counts = count_params(hf)
    if not propose:
        lay = layout_of(cfg, nodes, gpus_per_node)
        check_layout(cfg, hf, nodes, gpus_per_node, here=False)
        check_kv_cache(hf, cfg, lay, precision)
    else:
        lay, best = None, None  # the first that fits; else the one closest to fitting
        for cand in candidates(hf, nodes, gpus_per_node):
            try:
                check_layout(apply_layout(cfg, cand), hf, nodes, gpus_per_node, here=False)
                check_kv_cache(hf, cfg, cand, precision)
            except ConfigError:
                continue
            total = memory_gib(counts, hf, cfg, cand, precision, cpu)["total"]
            if total <= gpu_mem_gib:
                lay = cand
                break
            best = min(best or (total, cand), (total, cand), key=lambda x: x[0])
        if lay is None and best is None:
            check_layout(cfg, hf, nodes, gpus_per_node, here=False)  # nothing is valid: the configured layout's error
            check_kv_cache(hf, cfg, layout_of(cfg, nodes, gpus_per_node), precision)
            raise ConfigError(f"no valid layout for {nodes} nodes × {gpus_per_node} GPUs")
        lay = lay or best[1]
    mem = memory_gib(counts, hf, cfg, lay, precision, cpu)
    info = {k: mem.pop(k) for k in ("optimizer_without_distributed", "activations_full_recompute",
                                    "kv_cache_needed", "kv_cache_sequences", "kv_cache_sequences_held")}
    return {
        "model_type": hf.get("model_type"), "experts": num_experts(hf), "params_total": counts.total,
        "params_active": counts.active,
        "layout": {"tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "ep": lay.ep, "etp": lay.etp, "dp": lay.dp,
                   "sequence_parallel": lay.sequence_parallel, "engine_tp": lay.engine_tp,
                   "engine_replicas": lay.world // lay.engine_tp},
        "nodes": nodes, "gpus_per_node": gpus_per_node, "gpu_mem_gib": gpu_mem_gib, "precision": precision,
        "bytes_per_param": bytes_per_param(cfg, precision),
        "device": "cpu" if cpu else "gpu",
        "memory_gib_per_gpu": mem, **info, "fits": mem["total"] <= gpu_mem_gib, "proposed": propose,
        "overrides": lay.overrides(), "sized_at": sizing(cfg),
        "routes": route_bytes_per_rank(route_bytes(hf, cfg), lay),
    }


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


def route_bytes_per_rank(routes: dict, lay) -> dict:
    """``routes`` (``route_bytes``) with what one trainer rank holds of a step's: today every rank holds every route
    (the samples gathered world-wide, R3's batch whole; R2's recording sends a rank its stage's layers only, into a
    batch-sized tensor); its own share would be its DP rows, its sequence chunk under sequence parallelism, its
    pipeline stage's layers."""
    if not routes:
        return routes
    share = lay.dp * (lay.tp if lay.sequence_parallel else 1) * lay.pp
    return {**routes, "gib_per_rank": routes["gib_per_step"], "gib_per_rank_own_share": routes["gib_per_step"] / share}


SIZING_KEYS = ("engine.max_model_len", "optim.micro_batch_size", "engine.slots", "rollout.prompts_per_step",
               "rollout.samples_per_prompt", "engine.kv_cache_gib", "trainer.max_tokens_per_microbatch")
"""The settings activations and the KV cache are sized at (the plan prints them; the token budget when set)."""


def sizing(cfg: RunConfig) -> dict:
    out = {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in SIZING_KEYS}
    if not (cfg.trainer.packing and out["trainer.max_tokens_per_microbatch"]):
        out.pop("trainer.max_tokens_per_microbatch")
    return out


def what_would_fit(hf: dict, cfg: RunConfig, nodes: int, gpus_per_node: int, gpu_mem_gib: float,
                   precision: str, explicit: bool = False, cpu: bool = False) -> list[str]:
    """When the plan does not fit: the nearest changes that would, each checked by a plan of its own — the layout
    ``megarl plan`` proposes for this job (``explicit``: the config named one), a KV cache that leaves room,
    bf16, more nodes."""
    hints = []
    if explicit:
        try:
            proposal = plan(hf, cfg, nodes, gpus_per_node, gpu_mem_gib, True, precision, cpu)
        except ConfigError:
            proposal = None
        if proposal is not None and proposal["fits"]:
            mine = set(layout_of(cfg, nodes, gpus_per_node).overrides())
            hints.append(" ".join(o for o in proposal["overrides"] if o not in mine) + " (the layout megarl plan "
                         f"proposes for this job: {proposal['memory_gib_per_gpu']['total']:.2f} GiB)")
        mine = plan(hf, cfg, nodes, gpus_per_node, gpu_mem_gib, False, precision, cpu)
        over = mine["memory_gib_per_gpu"]["total"] - gpu_mem_gib
        smaller = math.floor((cfg.engine.kv_cache_gib - over) * 4) / 4  # (a quarter GiB below what would just fit)
        if smaller > 0:
            lower = replace(cfg, engine=replace(cfg.engine, kv_cache_gib=smaller))
            try:
                if plan(hf, lower, nodes, gpus_per_node, gpu_mem_gib, False, precision, cpu)["fits"]:
                    held = kv_cache_use(hf, lower, layout_of(lower, nodes, gpus_per_node), precision)["held"]
                    hints.append(f"engine.kv_cache_gib={smaller:g} (holds {held} sequences at engine.max_model_len "
                                 "at once)")
            except ConfigError:  # it cannot hold one sequence
                pass
    if precision == "fp32" and plan(hf, cfg, nodes, gpus_per_node, gpu_mem_gib, not explicit, "bf16", cpu)["fits"]:
        hints.append("trainer.precision=bf16 (megatron's mixed precision)")
    for more in (2, 4, 8, 16):
        try:
            if plan(hf, cfg, nodes * more, gpus_per_node, gpu_mem_gib, True, precision, cpu)["fits"]:
                hints.append(f"--nodes {nodes * more} (× {gpus_per_node} {'processes' if cpu else 'GPUs'})")
                break
        except ConfigError:
            continue
    return hints


def _explicit(config: str | None, overrides: list[str]) -> set[str]:
    """Layout keys the user set, in the file or on the command line."""
    import yaml

    data = (yaml.safe_load(Path(config).read_text()) or {}) if config and Path(config).is_file() else {}
    keys = {f"parallel.{k}" for k in (data.get("parallel") or {})}
    if "tensor_parallel_size" in (data.get("engine") or {}):
        keys.add("engine.tensor_parallel_size")
    keys |= {o.split("=", 1)[0] for o in overrides}
    return {k for k in keys if k in LAYOUT_KEYS}


def read_model(path: str) -> dict:
    """An HF config from a checkpoint directory or a ``config.json`` file, refused (ConfigError) as ``megarl train``
    refuses it: an unsupported model_type, or a key that changes the math (``check_model_math``)."""
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise ConfigError(f"--model {path}: no such config.json or checkpoint directory (a local path: nothing is "
                          "downloaded; e.g. the directory a hub model was saved to, or examples/models/*.json)")
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--model {file}: not valid JSON ({exc})") from None
    if hf.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"--model {file}: model_type {hf.get('model_type')!r} is not supported; "
                          f"valid: {', '.join(SUPPORTED_MODEL_TYPES)}")
    try:  # `megarl train`'s refusals (read_hf_config), word for word: a plan that "fits" must be a run that starts
        check_model_math(hf, str(file))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return hf


def engine_only_nodes(cfg: RunConfig) -> int:
    """How many of the allocation's last nodes run only engine replicas (``engine.replica_nodes_dedicated``), else 0."""
    return cfg.engine.replica_nodes if cfg.engine.replica_nodes_dedicated else 0


def trainer_nodes(cfg: RunConfig, nodes: int) -> int:
    """The job's nodes that run trainer ranks: all but the engine-only ones (``engine.replica_nodes_dedicated``)."""
    engine_only = engine_only_nodes(cfg)
    if engine_only and nodes - engine_only < 1:
        raise ConfigError(f"--nodes {nodes} leaves no trainer node beside engine.replica_nodes={engine_only} "
                          f"engine-only nodes (engine.replica_nodes_dedicated=true); "
                          f"valid: --nodes >= {engine_only + 1}")
    return nodes - engine_only


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="megarl plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint directory or config.json (default: the config's model.path)")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu-mem-gib", type=float, default=80.0)
    ap.add_argument("--precision", choices=sorted(WEIGHT_BYTES), default=None,
                    help="the trainer's precision to size (default: the config's trainer.precision): bf16 is "
                    "megatron's mixed precision, fp32 everything in fp32; engines follow unless engine.dtype says")
    ap.add_argument("--cpu", action="store_true", help="size CPU processes (the tiny runs): --gpus-per-node is then "
                    "processes per node and --gpu-mem-gib the memory of each; no CUDA runtime overhead")
    ap.add_argument("--config", help="YAML config file")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("overrides", nargs="*", help="KEY.PATH=VALUE overrides, as for megarl train")
    args = ap.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.precision:
            cfg.trainer.precision = args.precision
        args.precision = cfg.trainer.precision
        if args.model:
            hf = read_model(args.model)
            model = Path(args.model)  # the model the checks name (e.g. a head size vLLM cannot run)
            cfg.model.path = str(model.parent if model.is_file() else model)
        else:
            hf = model_config(cfg)
        # Any layout key given: check and size exactly what `megarl train` would run; none: propose one.
        propose = not _explicit(args.config, args.overrides)
        nodes = trainer_nodes(cfg, args.nodes)
        res = plan(hf, cfg, nodes, args.gpus_per_node, args.gpu_mem_gib, propose, args.precision, args.cpu)
        if not args.config and not {o.split("=", 1)[0] for o in args.overrides} & set(SIZING_KEYS):
            res["sizing_note"] = ("the schema defaults, the tiny CPU demo's; give your run's with --config FILE "
                                  "or key=value")
        if not res["fits"]:
            res["would_fit"] = what_would_fit(hf, cfg, nodes, args.gpus_per_node, args.gpu_mem_gib, args.precision,
                                              explicit=not propose, cpu=args.cpu)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"megarl plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(res) if args.json else format_table(res))
    return 0 if res["fits"] else 1
