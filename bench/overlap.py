#!/usr/bin/env python
"""Generation beside training on this machine: ``rollout.overlap`` none vs one_step vs async, side by side.

The demo's task (``configs/demo.yaml``: GRPO on the tiny Qwen3-MoE, addition, 32 prompts × 8 samples per step),
disaggregated: one engine replica process and one trainer process, partial rollout, async at
``rollout.staleness_limit`` 2. Each mode runs ``--steps`` RL steps after a short warm-up; the first ``--skip``
steps are left out (the pipeline filling, first-call costs). For each run: trained samples per second of step wall
time (``timing/step_s``: generation or the wait for it, reward, train, sync), the staleness seen, and, of the
``none`` run, the measured phase times T_gen (``timing/gen_s``) and T_train (``timing/train_s`` + ``timing/sync_s``),
which give the ceiling overlap can reach at these settings, (T_gen + T_train) / max(T_gen, T_train).

``none`` runs at each of ``--sync-threads`` (OMP threads per process; it takes turns, so each side may use both
cores) and the best is the baseline; the overlapped modes at one thread per process (their two processes run at
once on two cores). The modes run one after the other, interleaved over ``--repeats`` rounds; the ratios are the
medians. ``--controller`` adds the SortedRL controller's cost per token event, on simulated engines, alone and
with a trainer's matmuls running in the same process (as rank 0 runs it beside training under overlap).

    .venv/bin/python bench/overlap.py [--steps 12] [--repeats 3] [--controller]
    .venv/bin/python bench/overlap.py --controller-only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run(mode: str, work: Path, tag: str, args, threads: int) -> dict:
    """One ``megarl train`` run; its figures from ``metrics.jsonl``."""
    from megarl.logging.metrics import read_metrics

    run_dir = work / tag
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", str(ROOT / "configs/demo.yaml"),
           f"model.path={work / 'model'}", f"train.run_dir={run_dir}", "engine.placement=disaggregated",
           "rollout.mode=partial", f"rollout.overlap={mode}", "rollout.staleness_limit=2",
           f"train.steps={args.steps}", "train.save_every=0", "train.time_limit_s=0", "data.eval_size=1",
           f"warmup.steps={args.warmup_steps}", f"train.seed={args.seed}", *args.overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{tag} failed ({out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "timing/step_s" in r][args.skip:]
    if not steps:
        raise SystemExit(f"{tag}: no step past --skip {args.skip}")
    wall = sum(r["timing/step_s"] for r in steps)
    samples = sum(r["rollout/groups_released"] for r in steps) * args.samples_per_prompt
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in steps)  # noqa: E731
    return {"mode": mode, "threads": threads, "samples_per_s": samples / wall, "step_s": wall / len(steps),
            "t_gen": mean("timing/gen_s"), "t_train": mean("timing/train_s") + mean("timing/sync_s"),
            "trainer_wait_s": mean("timing/trainer_wait_s"), "engine_idle_s": mean("timing/engine_idle_s"),
            "overlap_fraction": mean("pipeline/overlap_fraction"),
            "staleness_max": max(r["rollout/staleness_max"] for r in steps)}


def controller_cost() -> dict:
    """µs of Python per token event of the real controller on simulated engines (64 slots × 4 engines), alone and
    with a matmul loop in the main thread (a trainer's kernels, which release the GIL as torch's do)."""
    import torch

    from megarl.rollout.sim.simulator import SimSettings, paper_workload, simulate

    def timed() -> tuple[float, int]:
        s = SimSettings(group_size=8, engines=4, slots=64, prompts_per_step=32, max_tokens=4096, steps=6,
                        max_chunk=1)
        start = time.thread_time()
        out = simulate(paper_workload(0, 128, 8, 4096), "partial", s)
        return time.thread_time() - start, out["tokens_generated"]

    alone_s, events = timed()
    stop, result = threading.Event(), {}

    def controller() -> None:
        result["cpu_s"], result["events"] = timed()
        stop.set()

    a = torch.randn(512, 512)
    worker = threading.Thread(target=controller)
    worker.start()
    while not stop.is_set():
        a = torch.tanh(a @ a.T / 512)
    worker.join()
    return {"controller_us_per_event_alone": alone_s / events * 1e6,
            "controller_us_per_event_beside_training": result["cpu_s"] / result["events"] * 1e6,
            "events": events}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="first steps not counted")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=100, help="supervised warm-up (the format), each run")
    p.add_argument("--samples-per-prompt", type=int, default=8, help="the demo's (rollout.samples_per_prompt)")
    p.add_argument("--sync-threads", default="1,2", help="OMP threads per process tried for none (the best counts)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--controller", action="store_true", help="also the controller's cost per token event")
    p.add_argument("--controller-only", action="store_true", help="only the controller's cost per token event")
    p.add_argument("overrides", nargs="*", help="more key=value settings for every run")
    args = p.parse_args()
    if args.steps <= args.skip or args.repeats < 1:
        raise SystemExit("--steps must exceed --skip, --repeats >= 1")
    if args.controller_only:
        print(json.dumps(controller_cost()), flush=True)
        return 0
    args.overrides.append(f"rollout.samples_per_prompt={args.samples_per_prompt}")
    sync_threads = [int(t) for t in args.sync_threads.split(",")]
    rounds = []
    with tempfile.TemporaryDirectory(prefix="megarl-overlap-") as tmp:
        work = Path(tmp)
        for r in range(args.repeats):
            none = [run("none", work, f"none-{t}-{r}", args, t) for t in sync_threads]
            best = max(none, key=lambda x: x["samples_per_s"])
            got = {m: run(m, work, f"{m}-{r}", args, 1) for m in ("one_step", "async")}
            ceiling = (best["t_gen"] + best["t_train"]) / max(best["t_gen"], best["t_train"])
            line = {"round": r, "none": best, **got, "ceiling": ceiling,
                    **{f"{m}_vs_none": got[m]["samples_per_s"] / best["samples_per_s"] for m in got},
                    "async_of_ceiling": got["async"]["samples_per_s"] / best["samples_per_s"] / ceiling}
            print(json.dumps(line), flush=True)
            rounds.append(line)
    med = {k: statistics.median(x[k] for x in rounds)
           for k in ("one_step_vs_none", "async_vs_none", "ceiling", "async_of_ceiling")}
    med["none_threads"] = statistics.mode(x["none"]["threads"] for x in rounds)
    med["t_gen"], med["t_train"] = (statistics.median(x["none"][k] for x in rounds) for k in ("t_gen", "t_train"))
    if args.controller:
        med.update(controller_cost())
    print(json.dumps({"median_of": len(rounds), **med}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
