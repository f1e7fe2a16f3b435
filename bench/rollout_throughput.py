#!/usr/bin/env python
"""Real-engine rollout throughput: sync vs SortedRL on-policy vs partial, interleaved and repeated in one process.

vLLM's CPU build, a tiny dense model, a length-controlled workload (``ignore_eos``
with each sample's length drawn from a heavy-tailed distribution, fixed seed).
The same controller code as training drives the engine; no training happens, the
policy version just advances per phase.

Fair accounting: every mode gets the same ``phases × prompts_per_step`` prompts and
runs until each of them is trained, so no tokens are left in a buffer and the
modes do the same work; the time is each mode's wall time for it (a SortedRL mode
pays its own tail: the last phases, when only long prompts remain). The modes run
interleaved (``--repeats`` rounds, the order rotated each round) and each figure is
the median over rounds. Rates are per CPU second of this process (the engine runs
in it with one thread), which other load on a shared machine barely moves; per wall
second is printed too. Prints one JSON line per (round, mode), then the medians and
the ratios to sync in output tokens/s and useful tokens/s (tokens that reach the loss),
and the update batch per step (every mode: ``prompts_per_step``).

    .venv/bin/python bench/rollout_throughput.py [--phases 8] [--repeats 3] [--slots 64]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

from megarl.engines.vllm_engine import VLLMEngine, VLLMSlotEngine, set_cpu_engine_env
from megarl.models.tiny import TinyShape, make_tiny_model
from megarl.rollout.controller import ControllerConfig, PromptItem, RolloutController
from megarl.rollout.phase_metrics import PhaseMetrics

MODES = ("sync", "on_policy", "partial")


def heavy_tailed_lengths(rng: random.Random, groups: int, group_size: int, cap: int) -> list[list[int]]:
    """Per group: 80% short (8–48 tokens), 15% long (48–cap), 5% at the cap."""
    out, short = [], min(48, cap)
    for _ in range(groups):
        u = rng.random()
        lo, hi = (min(8, short), short) if u < 0.80 else ((short, cap) if u < 0.95 else (cap, cap))
        out.append([rng.randint(lo, hi) for _ in range(group_size)])
    return out


def run_mode(engine: VLLMEngine, mode: str, lengths: list[list[int]], args) -> dict:
    prompts = args.phases * args.prompts_per_step
    counter = {"i": 0}

    def next_prompt():
        i = counter["i"]
        if i >= prompts:
            return None
        counter["i"] += 1
        return PromptItem(i, [3 + i % 10, 4, 12, 5 + i % 7, 16], key=i % len(lengths))

    def length_of(key):
        return lengths[key[0] % len(lengths)][key[1]]

    cfg = ControllerConfig(mode=mode, group_size=args.group_size, update_groups=args.prompts_per_step,
                           rollout_groups=args.prompts_per_step * (1 if mode == "sync" else 2),
                           max_tokens=args.cap, staleness_limit=args.staleness_limit, temperature=1.0,
                           long_rounds=True)
    ctrl = RolloutController(cfg, [VLLMSlotEngine(engine, args.slots, length_of)], next_prompt)
    total, batches, version, t0, c0 = PhaseMetrics(), [], 0, time.perf_counter(), time.process_time()
    while len(ctrl.released) < prompts and version < 20 * args.phases:
        groups, m = ctrl.run_phase(version)
        total.merge(m)
        batches.append(len(groups))
        version += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = {k.split("/", 1)[1]: v for k, v in total.summary().items()}
    return {"mode": mode, "bubble_ratio": out["bubble_ratio"], "tokens_per_cpu_s": total.tokens_generated / cpu,
            "useful_tokens_per_cpu_s": total.tokens_useful / cpu, "tokens_per_s": total.tokens_generated / wall,
            "useful_tokens_per_s": total.tokens_useful / wall, "wasted_token_fraction": out["wasted_token_fraction"],
            "samples_trained": total.samples_trained, "phases": version, "seconds": wall, "cpu_seconds": cpu,
            "groups_per_step_max": max(batches), "groups_per_step_mean": sum(batches) / len(batches)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", type=int, default=8, help="prompts per mode = phases × prompts per step")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; figures are medians over rounds")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--cap", type=int, default=256)
    p.add_argument("--staleness-limit", type=int, default=8, help="partial mode's k")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if min(args.phases, args.repeats, args.slots, args.group_size, args.prompts_per_step, args.cap) < 1:
        raise SystemExit("--phases, --repeats, --slots, --group-size, --prompts-per-step and --cap must be >= 1")
    set_cpu_engine_env(1)
    import vllm  # noqa: F401

    from megarl.trainer.parallel import init_process_group

    init_process_group()
    lengths = heavy_tailed_lengths(random.Random(args.seed), args.phases * args.prompts_per_step, args.group_size,
                                   args.cap)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(f"{tmp}/model", TinyShape(family="qwen2", max_position_embeddings=args.cap + 64))
        engine = VLLMEngine(str(model), args.cap + 32, 1.0, max_num_seqs=args.slots, seed=args.seed)
        run_mode(engine, "sync", lengths, argparse.Namespace(**{**vars(args), "phases": 1}))  # first-use costs
        for r in range(args.repeats):
            for mode in MODES[r % 3:] + MODES[:r % 3]:  # interleaved, the order rotated each round
                result = run_mode(engine, mode, lengths, args)
                runs[mode].append(result)
                print(json.dumps({"round": r, **result}), flush=True)
    med = {m: {k: statistics.median(x[k] for x in runs[m]) for k in runs[m][0] if k != "mode"} for m in MODES}
    base = med["sync"]
    for m in MODES:
        spread = [x["useful_tokens_per_cpu_s"] / y["useful_tokens_per_cpu_s"] for x, y in zip(runs[m], runs["sync"])]
        print(json.dumps({"mode": m, "median": True, **med[m],
                          "x_tokens_per_cpu_s": med[m]["tokens_per_cpu_s"] / base["tokens_per_cpu_s"],
                          "x_useful_tokens_per_cpu_s": med[m]["useful_tokens_per_cpu_s"] / base["useful_tokens_per_cpu_s"],
                          "x_useful_tokens_per_s": med[m]["useful_tokens_per_s"] / base["useful_tokens_per_s"],
                          "x_useful_per_round": [round(x, 3) for x in spread]}))
    for m in MODES[1:]:
        print(f"{m}: {med[m]['tokens_per_cpu_s'] / base['tokens_per_cpu_s']:.2f}x output tokens/s, "
              f"{med[m]['useful_tokens_per_cpu_s'] / base['useful_tokens_per_cpu_s']:.2f}x useful tokens/s vs sync "
              f"per CPU second ({med[m]['useful_tokens_per_s'] / base['useful_tokens_per_s']:.2f}x per wall second) "
              f"(median of {args.repeats}; bubble {med[m]['bubble_ratio']:.1%} vs {base['bubble_ratio']:.1%}, "
              f"{med[m]['wasted_token_fraction']:.1%} wasted, at most {med[m]['groups_per_step_max']:.0f} groups "
              f"per step)")


if __name__ == "__main__":
    main()
