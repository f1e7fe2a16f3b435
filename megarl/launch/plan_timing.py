"""``megarl plan``'s step-time lines: the GPU and work they assume, one ``step time`` line per ranked layout
(the form scripts read), and the shown layout's terms with the inputs of their formulas
(``megarl/launch/step_time.py`` computes them)."""

from __future__ import annotations

from megarl.launch.step_time import HBM_EFFICIENCY, step_line


def _s(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def assumptions(res: dict) -> str:
    """'timing  h100: 989 TFLOP/s bf16, …; 256 sequences of 1024 + 1536 tokens, MFU 0.25'."""
    g, w = res["gpu"], res["step_time"]["work"]
    return (f"timing  {g['name']}: {g['peak_tflops']:g} TFLOP/s bf16, {g['hbm_tbps']:g} TB/s HBM, NVLink "
            f"{g['nvlink_gbps']:g} GB/s, network {g['network_gbps']:g} GB/s, host {g['host_gbps']:g} GB/s; "
            f"{w['sequences']} sequences of {w['prompt_tokens']} + {w['response_tokens']} tokens "
            f"(--prompt-tokens, --response-tokens), MFU {res['step_time']['train']['mfu']:g}")


def ranked_lines(res: dict) -> list[str]:
    """One line per proposal, fastest first; without proposals (a layout given) the layout's own."""
    if not res["proposals"]:
        return [step_line(res["step_time"])]
    return [f"{step_line(p['step_time'])}   {n}. {p['describe']}, {p['memory_gib']:.1f} GiB"
            for n, p in enumerate(res["proposals"], 1)]


def train_terms(t: dict) -> str:
    return (f"  train   {_s(t['total_s']):>6} s = compute {_s(t['compute_s'])} ({t['flops']:.3g} FLOP of "
            f"{t['tokens']:,} tokens / {t['gpus']} GPUs × {t['peak_tflops']:g} TFLOP/s × MFU {t['mfu']:g})"
            + (f" + recompute {_s(t['recompute_s'])} ({t['recompute']}: {t['recompute_flops']:.3g} FLOP)"
               if t.get("recompute", "none") != "none" else "") + " + TP "
            f"{_s(t['tp_s'])} + EP {_s(t['ep_s'])}" + (f" + CP {_s(t['cp_s'])}" if t.get("cp_s") else "")
            + f" + PP bubble {_s(t['pp_s'])} ({t['microbatches']} micro-batches)"
            f" + DP {_s(t['dp_s'])} + optimizer {_s(t['optimizer_s'])}"
            + (f" + reference swap {_s(t['reference_swap_s'])}" if t.get("reference_swap_s") else "")
            + (" (a reference forward included)" if t["reference_forward"] else ""))


def rollout_terms(r: dict) -> str:
    tail = f" + {r['tail_steps']:,.0f} tail" if r["tail_steps"] else ""
    comm = f", TP collectives {r['comm_s'] * 1e3:.2f} ms{' across nodes' if r['across_nodes'] else ''}" \
        if r["engine_tp"] > 1 else ""
    bound = "compute-bound" if r["compute_bound"] else f"reads at HBM × {HBM_EFFICIENCY:g}"
    again = (f" + recompute {_s(r['recompute_s'])} ({r['preempted']} sequences a replica preempted when its KV cache "
             "fills, prefilled again)") if r.get("preempted") else ""
    return (f"  rollout {_s(r['total_s']):>6} s = prefill {_s(r['prefill_s'])} + decode {_s(r['decode_s'])} "
            f"({r['replicas']} replica{'s' if r['replicas'] > 1 else ''} × batch {r['batch']}: "
            f"{r['useful_steps']:,.0f} steps{tail} × {r['decode_step_s'] * 1e3:.2f} ms; weights "
            f"{r['weight_bytes'] / 1e9:.2f} GB + KV {r['kv_bytes'] / 1e9:.2f} GB + sampler "
            f"{r['sampler_bytes'] / 1e9:.2f} GB per GPU, {bound}{comm}){again}")


def sync_terms(s: dict) -> str:
    return (f"  sync    {_s(s['total_s']):>6} s = weights {_s(s['transfer_s'])} ({s['bytes'] / 1e9:.2f} GB over "
            f"{s['path']}) + sleep/wake {_s(s['sleep_s'])} + offload {_s(s['offload_s'])}")


def timing_lines(res: dict) -> list[str]:
    """The whole step-time block ([] on CPU: no step-time model there)."""
    st = res.get("step_time")
    if not st:
        return []
    combine = ("max(train, rollout) + sync (rollout.overlap)" if st["overlap"] else "train + rollout + sync")
    return [assumptions(res), *ranked_lines(res), f"terms of the layout shown ({combine}):",
            train_terms(st["train"]), rollout_terms(st["rollout"]), sync_terms(st["sync"])]
