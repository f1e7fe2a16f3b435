#!/usr/bin/env python
"""Generation beside training on this machine: ``rollout.overlap`` none vs one_step vs async, side by side.

The demo's task (``configs/demo.yaml``: GRPO on the tiny Qwen3-MoE, addition, 32 prompts × 8 samples per step),
disaggregated: one engine replica process and one trainer process, partial rollout, async at
``rollout.staleness_limit`` 2. Each mode runs ``--steps`` RL steps from one warm start (the supervised
warm-up runs once and its policy, exported as an HF checkpoint, starts every run); the first ``--skip`` steps are left
out (the pipeline filling, first-call costs). For each run: trained samples and trained tokens per
second of step wall time (``timing/step_s``: generation or the wait for it, reward, train, sync), the staleness
seen, the share of generated tokens wasted (partial samples regenerated once stale: ``rollout/wasted_token_fraction``)
and the phase times T_gen (``timing/gen_s``) and T_train (``timing/train_s`` + ``timing/sync_s``). Both units
are printed: the modes' answers part in length as their policies part (generation's cost follows the tokens and
their length; a training step's, packed, the tokens; ``trainer.packing=false``: the batch's longest row).
A warm-up per run could end elsewhere and answer at other lengths: hence the one warm start.

Nothing is set in the environment and no thread setting is given: each run computes on the cores megarl chooses
(``distributed/placement.py``: the trainer and the replica split the node's cores while generation runs beside
training, and each has every core while they take turns), which every run prints and this script reports
(``placement``). The figures are against ``none`` as a user gets it (``*_vs_none``, in samples and in trained tokens
per second); ``ceiling`` is what overlap could reach from ``none``'s phase times, (T_gen + T_train) / max(T_gen,
T_train), with each side as fast as it is alone on every core (an upper bound: a side on half the cores is slower).
The modes run one after the other, interleaved over ``--repeats`` rounds; the figures are the medians.
One_step and async train stale tokens, so they run AReaL's decoupled objective (``algo.decoupled_ppo: auto``: a
proximal forward over the batch each step); ``--uncorrected`` adds both with it off, and ``*_correction_cost`` is
their trained tokens per second without it over with it. ``--controller`` adds the SortedRL controller's cost per
token event, on simulated engines, alone and with a
trainer's matmuls running in the same process (as rank 0 runs it beside training under overlap). Settings after
the options go to every run: ``data.max_digits=12 data.tail_alpha=0.5 rollout.max_new_tokens=128
engine.max_model_len=160`` gives the task a longer tail (the demo's step is training-heavy).

``--equal-wall S`` instead asks what overlap does to learning: for each of ``--seeds``, the demo's own recipe
(its warm-up, 200 held-out prompts) trains ``S`` seconds of RL wall time under each of ``--wall-modes`` and reports
pass@1 after RL, the steps each fitted in ``S``, and each mode's pass@1 minus ``none``'s, per seed and averaged.

    .venv/bin/python bench/overlap.py [--steps 12] [--repeats 3] [--controller] [--uncorrected]
    .venv/bin/python bench/overlap.py --controller-only
    .venv/bin/python bench/overlap.py --equal-wall 300 [--seeds 0,1,2] [--wall-modes none,async]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def train(work: Path, tag: str, mode: str, settings: list[str], model: Path | None = None) -> tuple[list[dict], str]:
    """One ``megarl train`` run of the demo, disaggregated and partial (async at staleness 2), from ``model`` (default:
    the demo's tiny model, made once in ``work``); its metrics rows and the cpu placement it chose."""
    from megarl.logging.metrics import read_metrics

    run_dir = work / tag
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", str(ROOT / "configs/demo.yaml"),
           f"model.path={model or work / 'model'}", f"train.run_dir={run_dir}", "engine.placement=disaggregated",
           "rollout.mode=partial", f"rollout.overlap={mode}", "rollout.staleness_limit=2", "train.save_every=0",
           *settings]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{tag} failed ({out.returncode}):\n{(out.stdout + out.stderr)[-4000:]}")
    placement = next((line.split("megarl: ", 1)[1] for line in (out.stdout + out.stderr).splitlines()
                      if "cpu placement" in line), "")
    return read_metrics(run_dir / "metrics.jsonl"), placement


def warm_start(work: Path, args) -> Path:
    """The supervised warm-up of every ratio run, once: its policy as an HF checkpoint (``run_dir/hf/step_0``)."""
    train(work, "warm", "none", ["train.steps=0", "data.eval_size=1", f"warmup.steps={args.warmup_steps}",
                                 f"train.seed={args.seed}", *args.overrides])
    return work / "warm" / "hf" / "step_0"


def run(mode: str, work: Path, tag: str, args, warm: Path, *extra: str) -> dict:
    """Throughput figures of one run of ``--steps`` steps from ``warm`` (the first ``--skip`` left out)."""
    rows, placement = train(work, tag, mode, [f"train.steps={args.steps}", "train.time_limit_s=0", "data.eval_size=1",
                                              "warmup.steps=0", f"train.seed={args.seed}", *args.overrides, *extra],
                            warm)
    steps = [r for r in rows if "timing/step_s" in r][args.skip:]
    if not steps:
        raise SystemExit(f"{tag}: no step past --skip {args.skip}")
    wall = sum(r["timing/step_s"] for r in steps)
    samples = sum(r["rollout/groups_released"] for r in steps) * args.samples_per_prompt
    tokens = sum(r["rollout/groups_released"] * args.samples_per_prompt * r["rollout/len_trained_mean"] for r in steps)
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in steps)  # noqa: E731
    return {"mode": mode, "placement": placement, "samples_per_s": samples / wall, "tokens_per_s": tokens / wall,
            "len_trained_mean": tokens / samples, "step_s": wall / len(steps),
            "t_gen": mean("timing/gen_s"), "t_train": mean("timing/train_s") + mean("timing/sync_s"),
            "trainer_wait_s": mean("timing/trainer_wait_s"), "engine_idle_s": mean("timing/engine_idle_s"),
            "overlap_fraction": mean("pipeline/overlap_fraction"),
            "staleness_mean": mean("rollout/staleness_mean"),
            "staleness_max": max(r["rollout/staleness_max"] for r in steps),
            "wasted_token_fraction": mean("rollout/wasted_token_fraction")}


def ratios(none: dict, got: dict[str, dict]) -> dict:
    """One round's figures: each overlapped mode against ``none``, in samples and in trained tokens per second, and
    ``ceiling`` = (T_gen + T_train) / max(T_gen, T_train) of the ``none`` run (see the module docstring)."""
    line = {"none": none, **got}
    for m in got:
        line[f"{m}_vs_none"] = got[m]["samples_per_s"] / none["samples_per_s"]
        line[f"{m}_tokens_vs_none"] = got[m]["tokens_per_s"] / none["tokens_per_s"]
    line["ceiling"] = (none["t_gen"] + none["t_train"]) / max(none["t_gen"], none["t_train"])
    line["async_of_ceiling"] = line["async_tokens_vs_none"] / line["ceiling"]
    for m in ("one_step", "async"):  # --uncorrected: what the default off-policy correction costs
        if f"{m}_uncorrected" in got:
            line[f"{m}_correction_cost"] = got[f"{m}_uncorrected"]["tokens_per_s"] / got[m]["tokens_per_s"]
    return line


def equal_wall(work: Path, args) -> None:
    """pass@1 after ``args.equal_wall`` seconds of RL, per mode and seed (the demo's warm-up and evaluation)."""
    modes = args.wall_modes.split(",")
    per_seed = []
    for seed in (int(x) for x in args.seeds.split(",")):
        line = {"seed": seed}
        for mode in modes:
            rows, _ = train(work, f"wall-{mode}-{seed}", mode, ["train.steps=100000",
                                                                f"train.time_limit_s={args.equal_wall}",
                                                                f"train.seed={seed}", *args.overrides])
            evals = [r["eval/pass_at_1"] for r in rows if "eval/pass_at_1" in r]
            steps = [r for r in rows if "timing/step_s" in r]
            line[mode] = {"before": evals[0], "after": evals[-1], "steps": len(steps),
                          "wasted_token_fraction": statistics.fmean(r["rollout/wasted_token_fraction"] for r in steps)}
        for mode in modes[1:]:
            line[f"{mode}_minus_{modes[0]}"] = line[mode]["after"] - line[modes[0]]["after"]
        print(json.dumps(line), flush=True)
        per_seed.append(line)
    print(json.dumps({"seeds": len(per_seed), "rl_wall_s": args.equal_wall,
                      **{f"{m}_after_mean": statistics.fmean(x[m]["after"] for x in per_seed) for m in modes},
                      **{f"{m}_steps_mean": statistics.fmean(x[m]["steps"] for x in per_seed) for m in modes},
                      **{f"{m}_minus_{modes[0]}_mean": statistics.fmean(x[f"{m}_minus_{modes[0]}"] for x in per_seed)
                         for m in modes[1:]}}), flush=True)


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
    p.add_argument("--warmup-steps", type=int, default=100, help="supervised warm-up (the format), once")
    p.add_argument("--samples-per-prompt", type=int, default=8, help="the demo's (rollout.samples_per_prompt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--controller", action="store_true", help="also the controller's cost per token event")
    p.add_argument("--controller-only", action="store_true", help="only the controller's cost per token event")
    p.add_argument("--equal-wall", type=float, default=0.0,
                   help="seconds of RL per run: pass@1 at equal wall time instead of the throughput ratios")
    p.add_argument("--seeds", default="0,1,2", help="train.seed of the --equal-wall runs")
    p.add_argument("--wall-modes", default="none,async", help="rollout.overlap of the --equal-wall runs (first: the "
                   "baseline)")
    p.add_argument("--uncorrected", action="store_true", help="also one_step and async with algo.decoupled_ppo="
                   "false: the cost of their default off-policy correction (a proximal forward per step)")
    p.add_argument("overrides", nargs="*", help="more key=value settings for every run")
    args = p.parse_args()
    if args.steps <= args.skip or args.repeats < 1:
        raise SystemExit("--steps must exceed --skip, --repeats >= 1")
    if args.controller_only:
        print(json.dumps(controller_cost()), flush=True)
        return 0
    if args.equal_wall:
        with tempfile.TemporaryDirectory(prefix="megarl-overlap-") as tmp:
            equal_wall(Path(tmp), args)
        return 0
    args.overrides.append(f"rollout.samples_per_prompt={args.samples_per_prompt}")
    rounds = []
    with tempfile.TemporaryDirectory(prefix="megarl-overlap-") as tmp:
        work = Path(tmp)
        warm = warm_start(work, args)
        for r in range(args.repeats):
            none = run("none", work, f"none-{r}", args, warm)
            got = {m: run(m, work, f"{m}-{r}", args, warm) for m in ("one_step", "async")}
            if args.uncorrected:  # the same modes with the decoupled objective (their default) turned off
                got.update({f"{m}_uncorrected": run(m, work, f"{m}-uncorrected-{r}", args, warm,
                                                    "algo.decoupled_ppo=false") for m in ("one_step", "async")})
            line = {"round": r, **ratios(none, got)}
            print(json.dumps(line), flush=True)
            rounds.append(line)
    keys = [k for k, v in rounds[0].items() if isinstance(v, float)]
    med = {k: statistics.median(x[k] for x in rounds) for k in keys}
    med["placement"] = {m: rounds[-1][m]["placement"] for m in ("none", "one_step", "async")}
    if args.controller:
        med.update(controller_cost())
    print(json.dumps({"median_of": len(rounds), **med}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
