"""``megarl plan``: parameter counts from an HF config alone, memory per GPU of a layout, its step time, and a
proposal: the fastest layout that fits.

    megarl plan --model examples/models/qwen3-30b-a3b.json --nodes 2 --gpus-per-node 8 --gpu h100 [--gpu-mem-gib 80]
                [--config FILE] [key=value ...] [--json]

``--model`` is a local checkpoint directory or ``config.json`` (nothing is downloaded; ``examples/models/`` holds
the shapes of the example models). Memory is sized at the config's sequence length and batch
(``engine.max_model_len``, ``optim.micro_batch_size`` or ``trainer.max_tokens_per_microbatch``, ``engine.slots``, the
rollout's sequences): without ``--config`` and those keys, a GPU plan takes a long-reasoning step (``LONG_REASONING``:
32 prompts × 16 samples, responses to 16k tokens, half of each GPU for vLLM) and ``--cpu`` the schema defaults, the
tiny CPU demo's 256-token sequences; give yours with ``--config FILE`` or ``key=value``.

Without any ``parallel.*``, ``engine.tensor_parallel_size``, ``engine.placement`` or ``engine.replicas`` setting,
it weighs every layout — the trainer's TP × PP × EP × expert TP; engines colocated at each ``engine.sleep_level``
(with and without ``trainer.offload_during_rollout``), on engine-only nodes, or on each node's last GPUs (the
trainer on the others: TRAINER_GPUS_PER_NODE, ``--trainer-gpus-per-node``); engine TP × replicas — and proposes
the fastest that fits, the next two beside it, each on a line

    step time  12.3 s/step (train 7.1 s, rollout 9.8 s, sync 0.6 s; rollout-bound)  1. colocated, sleep 1: ...

(training-, rollout- or sync-bound: its largest term). When no layout fits, the closest is shown and the plan says
what would fit. With a layout given, it checks and sizes that one and prints its step time.

The step-time model (``megarl/launch/step_time.py``, each term printed with its inputs):
  train    FLOPs (6 × active parameters × trained tokens, + attention) over trainer GPUs × peak × MFU, plus TP,
           EP all-to-all, the PP bubble and DP/optimizer communication from message sizes over NVLink or the
           network
  rollout  prefill compute-bound; decode memory-bound (weights and KV cache read per token step over HBM
           bandwidth, at the batch each replica holds), replicas in parallel, the sync-mode tail or the mode's
           measured bubble; sequences vLLM admits beyond what its cache holds, preempted and prefilled again
  sync     weight bytes per engine GPU over NVLink or the network, sleep/wake (level 1) and offload over the host
  step     their sum; with disaggregated engines and rollout.overlap one_step/async, max(train, rollout) + sync
The GPU's figures come from ``--gpu`` (a100, h100, h200, b200) or the flags of the same name; the lengths from
``--prompt-tokens`` / ``--response-tokens`` (defaults: half the budgets); ``--mfu`` and ``--bubble`` set the
assumptions. ``--cpu`` sizes CPU processes and proposes the first layout that fits (no step time).

Memory per GPU (``megarl/launch/memory.py``): the trainer's weights, fp32 gradients, optimizer state (sharded by
the distributed optimizer), activations of a micro-batch (under ``trainer.recompute``: the config's when set, else
each mode weighed: none, selective, full), chunked logits; the engine's weights (/ engine TP) and
``engine.kv_cache_gib``; 2 GiB runtime overhead; the peak over the phases (engines asleep while training at sleep
level 1 or 2; engine-only GPUs apart). w is ``trainer.precision``'s bytes (bf16: 2 B, fp32: 4 B); the engine's take
``engine.dtype``'s (auto: the trainer's). Exit status: 0 fits, 1 does not fit, 2 bad layout or input.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from megarl.config import ConfigError, load_config
from megarl.config.schema import RunConfig
from megarl.config.validate.algo import reference_kept
from megarl.config.validate.model import model_config, routes_off_note
from megarl.launch.gpus import PRESETS, Gpu
from megarl.launch.layout import (
    Layout,
    check_layout,
    engine_only_nodes,
    layout_of,
    trainer_gpus_per_node,
    trainer_nodes,
)
from megarl.launch.memory import (
    GIB,
    bytes_per_param,
    check_kv_cache,
    kv_cache_use,
    memory_gib,
    route_bytes,
    route_bytes_per_rank,
)
from megarl.launch.model_size import count_params
from megarl.launch.plan_args import parser, work_and_gpu
from megarl.launch.plan_table import format_table
from megarl.launch.ranking import RECOMPUTE_MODES, ranked
from megarl.launch.step_time import Work, step_time, work_of
from megarl.models.hf_config import SUPPORTED_MODEL_TYPES, check_model_math, num_experts

__all__ = ["GIB", "check_layout", "count_params", "engine_only_nodes", "main", "plan", "route_bytes",
           "trainer_nodes"]

LAYOUT_KEYS = {*(f"parallel.{k}" for k in ("tp", "pp", "vpp", "ep", "etp", "sequence_parallel")),
               *(f"engine.{k}" for k in ("tensor_parallel_size", "placement", "replicas"))}
"""Setting any of these (file or command line) means: check this layout; none: propose one."""
INFO_KEYS = ("optimizer_without_distributed", "activations_full_recompute", "activations_by_recompute",
             "kv_cache_needed", "kv_cache_sequences", "kv_cache_sequences_held", "peak")


def plan(hf: dict, cfg: RunConfig, nodes: int, gpus_per_node: int, gpu_mem_gib: float, propose: bool = False,
         precision: str = "", cpu: bool = False, gpu: Gpu | None = None, work: Work | None = None,
         rank: bool = True, trainer_gpus: int = 0, recompute: tuple[str, ...] = RECOMPUTE_MODES,
         cps: tuple[int, ...] | None = None) -> dict:
    """Counts, layout, memory and step time: of the config's layout (ConfigError if impossible), or with
    ``propose`` of the fastest valid layout that fits (``--cpu``: the first; else the one closest to fitting),
    the next ones beside it. ``nodes``: the job's, engine-only nodes included. Checked for the cluster, not for
    this machine (a login node's vLLM build does not say which attention head sizes the GPUs run).
    ``precision``: the trainer's to size ('': the config's ``trainer.precision``); ``gpu``: its figures (default
    the h100 preset); ``work``: the step's sequences and lengths (default ``work_of`` the config); ``rank``: weigh
    every layout (False: the first that fits, enough to say whether one does); ``trainer_gpus``: the trainer's
    processes per node (TRAINER_GPUS_PER_NODE; 0: ``gpus_per_node`` less the GPUs ``engine.replica_devices`` takes
    there), below ``gpus_per_node`` proposing only the splits that give each node's other GPUs to replicas;
    ``recompute``: the ``trainer.recompute`` modes a proposal weighs (the config's alone when it sets the key);
    ``cps``: the ``parallel.cp`` it weighs (None: 1, and more for long responses where nothing fits,
    ``ranking.ranked``)."""
    precision = precision or cfg.trainer.precision
    cfg = replace(cfg, trainer=replace(cfg.trainer, precision=precision))
    counts = count_params(hf)
    gpu, work = (None, None) if cpu else (gpu or PRESETS["h100"], work or work_of(cfg, hf))
    proposals = []
    if not propose:
        lay = configured(hf, cfg, nodes, gpus_per_node, precision, trainer_gpus)
        mem = memory_gib(counts, hf, cfg, lay, precision, cpu, gpu_mem_gib)
        st = None if cpu else step_time(counts, hf, cfg, lay, gpu, work, mem)
    else:
        found = ranked(counts, hf, cfg, nodes, gpus_per_node, gpu_mem_gib, precision, cpu, gpu, work,
                       first_fit=not rank, trainer_gpus=trainer_gpus, recompute=recompute, cps=cps)
        if not found["valid"]:  # nothing is valid: the configured layout's error
            configured(hf, cfg, nodes, gpus_per_node, precision, trainer_gpus)
            raise ConfigError(f"no valid layout for {nodes} nodes × {gpus_per_node} GPUs")
        proposals = found["fitting"]
        if proposals:
            lay, mem, st = proposals[0]
        else:
            lay, mem = found["closest"]
            st = None if cpu else step_time(counts, hf, cfg, lay, gpu, work, mem)
    info = {k: mem.pop(k) for k in INFO_KEYS}
    experts = num_experts(hf)
    return {
        "model_type": hf.get("model_type"), "experts": experts, "params_total": counts.total,
        "params_active": counts.active, "layout": layout_dict(lay),
        "nodes": nodes, "gpus_per_node": gpus_per_node, "gpu_mem_gib": gpu_mem_gib, "precision": precision,
        "bytes_per_param": bytes_per_param(cfg, precision),
        "device": "cpu" if cpu else "gpu", "gpu": None if cpu else vars(gpu),
        "memory_gib_per_gpu": mem, **info, "fits": mem["total"] <= gpu_mem_gib, "proposed": propose,
        "overrides": lay.overrides(), "sized_at": sizing(cfg),
        "routes": route_bytes_per_rank(route_bytes(hf, cfg), lay, cfg.trainer.packing),
        "routes_off": routes_off_note(cfg, experts, not cpu, lay.placement, lay.engine_tp),
        "step_time": st, "proposals": [proposal(*p, bool(experts)) for p in proposals if p[2] is not None],
    }


def configured(hf: dict, cfg: RunConfig, nodes: int, gpus_per_node: int, precision: str,
               trainer_gpus: int = 0) -> Layout:
    """The config's layout on the job's trainer nodes, checked (ConfigError names the key)."""
    trainer = trainer_gpus_per_node(cfg, gpus_per_node, trainer_gpus)
    lay = layout_of(cfg, trainer_nodes(cfg, nodes), trainer)
    check_layout(cfg, hf, lay.nodes, trainer, here=False, node_gpus=gpus_per_node)
    check_kv_cache(hf, cfg, lay, precision)
    return lay


def layout_dict(lay: Layout) -> dict:
    return {"tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "ep": lay.ep, "etp": lay.etp, "dp": lay.dp,
            "sequence_parallel": lay.sequence_parallel, "engine_tp": lay.engine_tp,
            "engine_replicas": lay.engine_replicas, "placement": lay.placement, "sleep_level": lay.sleep_level,
            "offload_during_rollout": lay.offload, "engine_nodes": lay.engine_nodes, "trainer_nodes": lay.nodes,
            "engine_gpus": lay.engine_gpus, "trainer_gpus_per_node": lay.gpus_per_node,
            "replica_devices": "" if lay.colocated else lay.replica_devices, "recompute": lay.recompute,
            "recompute_layers": lay.recompute_layers, "cp": lay.cp}


def proposal(lay: Layout, mem: dict, st: dict, experts: bool) -> dict:
    """One ranked layout: what it is, its settings, its memory peak and its step time."""
    return {"layout": layout_dict(lay), "describe": lay.describe(experts), "overrides": lay.overrides(),
            "memory_gib": mem["total"], "step_time": st}


LONG_REASONING = ("rollout.prompts_per_step=32", "rollout.samples_per_prompt=16", "optim.micro_batch_size=1",
                  "engine.slots=256", "engine.gpu_memory_utilization=0.5")
"""The shape a GPU plan is sized at without ``--config`` or any sizing key (``long_reasoning``): a long-reasoning
step of 32 prompts × 16 samples, one row a micro-batch, vLLM's KV cache what half of each GPU leaves after the
engine's weights."""
LONG_RESPONSE, LONG_PROMPT = 16384, 1024


def long_reasoning(hf: dict) -> list[str]:
    """``LONG_REASONING`` with its lengths: responses capped at 16k tokens after prompts of up to 1k (the mean
    response half the cap), or the same split of the model's ``max_position_embeddings`` where that is shorter."""
    longest = min(LONG_RESPONSE + LONG_PROMPT, int(hf.get("max_position_embeddings") or LONG_RESPONSE + LONG_PROMPT))
    response = max(1, longest * LONG_RESPONSE // (LONG_RESPONSE + LONG_PROMPT))
    return [*LONG_REASONING, f"engine.max_model_len={longest}", f"rollout.max_new_tokens={response}"]

SIZING_KEYS = ("engine.max_model_len", "optim.micro_batch_size", "engine.slots", "rollout.prompts_per_step",
               "rollout.samples_per_prompt", "engine.kv_cache_gib", "trainer.max_tokens_per_microbatch")
"""The settings activations and the KV cache are sized at (the plan prints them; the token budget when set)."""


def sizing(cfg: RunConfig) -> dict:
    out = {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in SIZING_KEYS}
    if not (cfg.trainer.packing and out["trainer.max_tokens_per_microbatch"]):
        out.pop("trainer.max_tokens_per_microbatch")
    if cfg.engine.gpu_memory_utilization:  # (the KV cache is the rest of that share, not engine.kv_cache_gib)
        out["engine.gpu_memory_utilization"] = cfg.engine.gpu_memory_utilization
        out.pop("engine.kv_cache_gib")
    return out


def what_would_fit(hf: dict, cfg: RunConfig, nodes: int, gpus_per_node: int, gpu_mem_gib: float,
                   precision: str, explicit: bool = False, cpu: bool = False, gpu: Gpu | None = None,
                   work: Work | None = None, recompute: tuple[str, ...] = RECOMPUTE_MODES,
                   cps: tuple[int, ...] | None = None) -> list[str]:
    """When the plan does not fit: the nearest changes that would, each checked by a plan of its own — the layout
    ``megarl plan`` proposes for this job (``explicit``: the config named one), a KV cache that leaves room,
    full activation recompute, bf16, more nodes. ``recompute``: the modes the plan weighed."""
    hints = []

    def again(c: RunConfig, n: int, propose: bool, prec: str, rank: bool = False,
              modes: tuple[str, ...] = recompute) -> dict:
        return plan(hf, c, n, gpus_per_node, gpu_mem_gib, propose, prec, cpu, gpu, work, rank, recompute=modes,
                    cps=cps)

    if explicit:
        try:
            proposed = again(cfg, nodes, True, precision, rank=True)
        except ConfigError:
            proposed = None
        if proposed is not None and proposed["fits"]:
            mine = set(layout_of(cfg, nodes, gpus_per_node).overrides())
            hints.append(" ".join(o for o in proposed["overrides"] if o not in mine) + " (the layout megarl plan "
                         f"proposes for this job: {proposed['memory_gib_per_gpu']['total']:.2f} GiB)")
        mine = again(cfg, nodes, False, precision)
        over = mine["memory_gib_per_gpu"]["total"] - gpu_mem_gib
        smaller = math.floor((cfg.engine.kv_cache_gib - over) * 4) / 4  # (a quarter GiB below what would just fit)
        if smaller > 0:
            lower = replace(cfg, engine=replace(cfg.engine, kv_cache_gib=smaller))
            try:
                if again(lower, nodes, False, precision)["fits"]:
                    lay = layout_of(lower, trainer_nodes(lower, nodes), gpus_per_node)
                    held = kv_cache_use(hf, lower, lay, precision)["held"]
                    hints.append(f"engine.kv_cache_gib={smaller:g} (holds {held} sequences at engine.max_model_len "
                                 "at once)")
            except ConfigError:  # it cannot hold one sequence
                pass
    if "full" not in recompute or (explicit and cfg.trainer.recompute != "full"):
        full = replace(cfg, trainer=replace(cfg.trainer, recompute="full", recompute_layers=1))
        try:
            mine = again(full, nodes, not explicit, precision, modes=("full",))
            if mine["fits"]:
                hints.append(f"trainer.recompute=full (activations {mine['memory_gib_per_gpu']['activations']:.2f} "
                             f"GiB per GPU; about a third more training compute)")
        except ConfigError:
            pass
    if reference_kept(cfg) == "device":
        host = replace(cfg, trainer=replace(cfg.trainer, reference_on_host=True))
        try:
            if again(host, nodes, not explicit, precision)["fits"]:
                hints.append("trainer.reference_on_host=true (the KL reference's weights in host memory, copied into "
                             "the policy's model for its forward)")
        except ConfigError:
            pass
    if precision == "fp32" and again(cfg, nodes, not explicit, "bf16")["fits"]:
        hints.append("trainer.precision=bf16 (megatron's mixed precision)")
    for more in (2, 4, 8, 16):
        try:
            if again(cfg, nodes * more, True, precision)["fits"]:
                hints.append(f"--nodes {nodes * more} (× {gpus_per_node} {'processes' if cpu else 'GPUs'})")
                break
        except ConfigError:
            continue
    return hints


def _given(config: str | None, overrides: list[str]) -> set[str]:
    """The ``parallel.*``, ``engine.*`` and ``trainer.*`` keys the user set, in the file or on the command line."""
    import yaml

    data = (yaml.safe_load(Path(config).read_text()) or {}) if config and Path(config).is_file() else {}
    keys = {f"{section}.{k}" for section in ("parallel", "engine", "trainer") for k in (data.get(section) or {})}
    return keys | {o.split("=", 1)[0] for o in overrides}


def _explicit(config: str | None, overrides: list[str]) -> set[str]:
    """Layout keys the user set, in the file or on the command line."""
    return _given(config, overrides) & LAYOUT_KEYS


def recompute_modes(cfg: RunConfig, config: str | None, overrides: list[str]) -> tuple[str, ...]:
    """The ``trainer.recompute`` modes a proposal weighs: the config's when it sets the key, else all of them."""
    return (cfg.trainer.recompute,) if "trainer.recompute" in _given(config, overrides) else RECOMPUTE_MODES


def context_parallel_sizes(cfg: RunConfig, config: str | None, overrides: list[str]) -> tuple[int, ...] | None:
    """The ``parallel.cp`` a proposal weighs: the config's when it sets the key, else None (``ranking.ranked``)."""
    return (cfg.parallel.cp,) if "parallel.cp" in _given(config, overrides) else None


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


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_intermixed_args(argv)
    try:
        default_shape = not args.config and not args.cpu and not (
            {o.split("=", 1)[0] for o in args.overrides} & {*SIZING_KEYS, "rollout.max_new_tokens",
                                                             "engine.gpu_memory_utilization"})
        cfg = load_config(args.config, args.overrides)
        hf = read_model(args.model) if args.model else model_config(cfg)
        if default_shape:
            cfg = load_config(None, [*long_reasoning(hf), *args.overrides])
        if args.precision:
            cfg.trainer.precision = args.precision
        args.precision = cfg.trainer.precision
        if args.model:
            model = Path(args.model)  # the model the checks name (e.g. a head size vLLM cannot run)
            cfg.model.path = str(model.parent if model.is_file() else model)
        work, gpu, mem_gib = work_and_gpu(args, cfg, hf)
        # Any layout key given: check and size exactly what `megarl train` would run; none: propose one.
        propose = not _explicit(args.config, args.overrides)
        res = plan(hf, cfg, args.nodes, args.gpus_per_node, mem_gib, propose, args.precision, args.cpu, gpu, work,
                   trainer_gpus=args.trainer_gpus_per_node, recompute=recompute_modes(cfg, args.config, args.overrides),
                   cps=context_parallel_sizes(cfg, args.config, args.overrides))
        if default_shape:
            res["sizing_note"] = ("a long-reasoning step (32 prompts × 16 samples, responses to 16k tokens); give "
                                  "your run's with --config FILE or key=value")
        elif not args.config and not {o.split("=", 1)[0] for o in args.overrides} & set(SIZING_KEYS):
            res["sizing_note"] = ("the schema defaults, the tiny CPU demo's; give your run's with --config FILE "
                                  "or key=value")
        if not res["fits"]:
            res["would_fit"] = what_would_fit(hf, cfg, args.nodes, args.gpus_per_node, mem_gib, args.precision,
                                              not propose, args.cpu, gpu, work,
                                              recompute_modes(cfg, args.config, args.overrides),
                                              context_parallel_sizes(cfg, args.config, args.overrides))
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"megarl plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(res) if args.json else format_table(res))
    return 0 if res["fits"] else 1
