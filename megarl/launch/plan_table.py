"""``megarl plan``'s table: a plan's parameter counts, layout, memory per GPU by part, the sizes it was planned
at and, when no layout fits, what would (``megarl/launch/plan.py`` computes all of it)."""

from __future__ import annotations

from megarl.launch.plan_timing import timing_lines

ROWS = (("weights", "weights"), ("gradients", "gradients (fp32)"), ("optimizer", "optimizer state"),
        ("activations", "activations"), ("logits", "logits (chunked)"), ("reference", "KL reference (frozen)"),
        ("critic", "critic (GAE)"), ("engine_weights", "vLLM weights"),
        ("cuda_graphs", "vLLM CUDA graphs"), ("kv_cache", "vLLM KV cache"), ("overhead", "runtime overhead"))


def params(n: float) -> str:
    """A parameter count in the unit that shows it: '32.76 B' (billions), '3.05 M', '131.78 K', '512'."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def unit_of(res: dict) -> tuple[str, float]:
    """The table's one unit: GiB, or MiB where a part would show as 0.00 GiB (the tiny models)."""
    small = any(0 < v < 0.005 for v in res["memory_gib_per_gpu"].values())
    return ("MiB", 1024.0) if small else ("GiB", 1.0)


def amount(x_gib: float, res: dict, width: int = 0) -> str:
    """``x_gib`` in the table's unit, two decimals."""
    return f"{x_gib * unit_of(res)[1]:>{width}.2f}"


def _batch_key(res: dict) -> str:
    """The key that sizes a micro-batch's activations (``plan.microbatch_tokens``)."""
    budget = "trainer.max_tokens_per_microbatch"
    return budget if res["sized_at"].get(budget) else "optim.micro_batch_size"


def kv_note(res: dict) -> str:
    """engine.kv_cache_gib (the row's value) against what the rollout's sequences need at engine.max_model_len."""
    want, held, need = res["kv_cache_sequences"], res["kv_cache_sequences_held"], res["kv_cache_needed"]
    source = "engine.gpu_memory_utilization's rest" if res["sized_at"].get("engine.gpu_memory_utilization") \
        else "engine.kv_cache_gib"
    note = f"{source}; {want} sequences at engine.max_model_len need {amount(need, res)} {unit_of(res)[0]}"
    if held < want:
        note += f": it holds {held} at once at that length (vLLM admits up to engine.slots and preempts when it fills)"
    return note


def _device(res: dict) -> tuple[str, str]:
    """('GPU', 'GPU') or, sizing CPU processes, ('CPU process', 'process')."""
    return ("CPU process", "process") if res.get("device") == "cpu" else ("GPU", "GPU")


def model_line(res: dict) -> str:
    return (f"model   {res['model_type']}: {params(res['params_total'])} parameters, "
            f"{params(res['params_active'])} active per token")


def job_line(res: dict) -> str:
    bytes_note = (" (bytes per parameter: " + ", ".join(f"{k} {v}" for k, v in res["bytes_per_param"].items()) + ")"
                  if res.get("bytes_per_param") else "")
    return (f"job     {_count(res['nodes'], 'node')} × {_count(res['gpus_per_node'], _device(res)[0])} "
            f"of {res['gpu_mem_gib']:g} GiB, precision {res['precision']}{bytes_note}")


def layout_line(res: dict) -> str:
    lay = res["layout"]
    experts = f"EP {lay['ep']} · ETP {lay['etp']} · " if res.get("experts") else ""
    replicas = f"{lay['engine_replicas']} replica{'s' if lay['engine_replicas'] > 1 else ''}"
    recompute = f" · recompute {lay['recompute']}" if lay.get("recompute", "none") != "none" else ""
    cp = f"CP {lay['cp']} · " if lay.get("cp", 1) > 1 else ""
    return (f"layout  trainer TP {lay['tp']} · PP {lay['pp']} · VPP {lay['vpp']} · {experts}{cp}DP {lay['dp']}"
            f"{' (sequence parallel)' if lay['sequence_parallel'] else ''}{recompute} | vLLM TP {lay['engine_tp']} "
            f"× {replicas}"
            f"{engines_where(lay)}{'   [proposed]' if res['proposed'] else ''}")


def memory_lines(res: dict) -> list[str]:
    """The memory rows by part, then the total against the GPU's memory and the phase it peaks in."""
    mem = res["memory_gib_per_gpu"]
    notes = {"optimizer": f"without the distributed optimizer: {amount(res['optimizer_without_distributed'], res)}",
             "activations": recompute_note(res),
             "kv_cache": kv_note(res), "cuda_graphs": "estimated (engine.enforce_eager=true: none)"}
    lines = [f"memory per {_device(res)[1]} ({unit_of(res)[0]})"]
    for key, label in ROWS:
        if key in ("overhead", "cuda_graphs") and res.get("device") == "cpu" or key in ("reference", "critic") \
                and not mem.get(key):
            continue
        lines.append(f"  {label:<22}{amount(mem[key], res, 9)}   {notes.get(key, '')}".rstrip())
    verdict = "fits" if res["fits"] else "DOES NOT FIT"
    lines.append(f"  {'total':<22}{amount(mem['total'], res, 9)}   of {res['gpu_mem_gib']:g} GiB → {verdict} "
                 f"(the peak: {res['peak']})")
    return lines


def recompute_note(res: dict) -> str:
    """'trainer.recompute=full; none 9.19, selective 9.19, full 0.38': the activations under each mode."""
    mode = res["layout"].get("recompute", "none")
    by = res.get("activations_by_recompute") or {"full": res["activations_full_recompute"]}
    return f"trainer.recompute={mode}; " + ", ".join(f"{m} {amount(v, res)}" for m, v in by.items())


def routes_lines(res: dict) -> list[str]:
    """What MoE routing replay carries in host memory ([] for a dense model), or why it is off."""
    if res.get("routes_off"):
        return [f"routes  none: {res['routes_off']}"]
    if not res.get("routes"):
        return []
    r = res["routes"]
    return [f"routes  {r['bytes_per_token']} B per token (MoE routing replay); {r['gib_per_step']:.3g} GiB of "
            f"host memory for a step's {r['sequences']} sequences at engine.max_model_len",
            f"        {r['gib_per_rank']:.3g} GiB on each trainer rank: its own rows, layers and sequence chunk "
            f"{r['gib_per_rank_held']:.3g} GiB, a pass's rows {r['gib_per_rank_pass']:.3g} GiB; rank 0 also "
            f"the samples' routes, whole ({r['gib_rank_0']:.3g} GiB in all)"]


def sizing_line(res: dict) -> str:
    return ("sized at  " + " ".join(f"{k}={v}" for k, v in res["sized_at"].items())
            + (f"   ({res['sizing_note']})" if res.get("sizing_note") else ""))


def verdict_lines(res: dict) -> list[str]:
    """When nothing fits: what would (the given layout's nearest changes, or none of the proposals)."""
    if res["fits"]:
        return []
    if not res["proposed"]:
        return ["this layout does not fit at these sizes. "
                + (f"Would fit: {'; '.join(res['would_fit'])}; or" if res.get("would_fit") else "Try")
                + f" a shorter engine.max_model_len or a smaller {_batch_key(res)}"]
    device, per = _device(res)
    return [f"no layout of {_count(res['nodes'], 'node')} × {_count(res['gpus_per_node'], device)} fits in "
            f"{res['gpu_mem_gib']:g} GiB per {per} at these sizes; the one shown is the closest. "
            + (f"Would fit: {', '.join(res['would_fit'])}; or" if res.get("would_fit") else
               f"None fits with trainer.precision=bf16 or up to --nodes {16 * res['nodes']} either; try")
            + f" a shorter engine.max_model_len or a smaller {_batch_key(res)}"]


def format_table(res: dict) -> str:
    """The whole printout, one small function a part (a new line is a new function in this list)."""
    return "\n".join([model_line(res), job_line(res), layout_line(res), *memory_lines(res), *routes_lines(res),
                      sizing_line(res), *verdict_lines(res), settings_line(res),
                      *timing_lines(res)])


def settings_line(res: dict) -> str:
    """The layout's key=value settings for ``megarl train``, and the trainer's processes per node when the replicas
    take some of each node's GPUs (the launch scripts' TRAINER_GPUS_PER_NODE)."""
    trainer = res["layout"].get("trainer_gpus_per_node", res["gpus_per_node"])
    launch = (f"   (launch with TRAINER_GPUS_PER_NODE={trainer}: the trainer on GPUs 0..{trainer - 1} of each node, "
              f"sbatch --gpus-per-node {res['gpus_per_node']})" if trainer < res["gpus_per_node"] else "")
    return "settings  " + " ".join(res["overrides"]) + launch


def engines_where(lay: dict) -> str:
    """' colocated, asleep while training (sleep 1)', ' on 1 engine-only node', ' on GPUs 6,7 of each node'."""
    if lay.get("engine_gpus"):
        return f" on GPUs {lay['replica_devices']} of each node"
    if lay.get("placement", "colocated") != "colocated":
        n = lay["engine_nodes"]
        return f" on {n} engine-only node{'s' if n != 1 else ''}" if n else " disaggregated"
    asleep = f", asleep while training (sleep {lay['sleep_level']})" if lay.get("sleep_level") else ""
    return " colocated" + asleep + (", trainer offloaded while generating" if lay.get("offload_during_rollout")
                                    else "")
