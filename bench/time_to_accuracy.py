#!/usr/bin/env python
"""End-to-end value of SortedRL: pass@1 reached by sync, on-policy and partial rollout in the same wall budget.

Runs the demo's task (``configs/demo.yaml``: GRPO on the tiny Qwen3-MoE, addition
with a scratchpad) once per mode, each in its own process with the same seed and
the same supervised warm-up, hence the same warm start (the script checks that
pass@1 before RL agrees). The setting is generation-heavy: a longer length tail
than the demo (operands up to ``--max-digits`` digits, flatter power law, longer
length cap), so that generation dominates the step. Every mode gets the same
wall-clock budget for RL (``train.time_limit_s``) and is evaluated (greedy pass@1 on
held-out prompts) every ``--eval-every`` steps.

Prints one JSON line per mode with its curve (step, RL seconds, trained samples,
pass@1), then pass@1 at equal time (the RL seconds the slowest mode reached: the
last evaluation at or before it) and at equal samples (likewise, in trained
samples), per mode. RL seconds count generation + training + weight sync, not the
evaluations.

    .venv/bin/python bench/time_to_accuracy.py [--budget 60] [--eval-every 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("sync", "on_policy", "partial")


def curve(run_dir: Path, group_size: int) -> list[dict]:
    """(step, RL seconds, trained samples, pass@1) at every evaluation, from the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    per_step: dict[int, dict] = {}
    for tag in ("timing/gen_s", "timing/train_s", "timing/sync_s", "rollout/groups_released"):
        for e in acc.Scalars(tag) if tag in acc.Tags()["scalars"] else []:
            per_step.setdefault(e.step, {})[tag] = e.value
    seconds = samples = 0.0
    clock = {0: (0.0, 0.0)}
    for step in sorted(per_step):
        d = per_step[step]
        seconds += d.get("timing/gen_s", 0.0) + d.get("timing/train_s", 0.0) + d.get("timing/sync_s", 0.0)
        samples += d.get("rollout/groups_released", 0.0) * group_size
        clock[step] = (seconds, samples)
    out = []
    for e in acc.Scalars("eval/pass_at_1"):
        s, n = clock.get(e.step, clock[max(k for k in clock if k <= e.step)])
        out.append({"step": e.step, "rl_s": round(s, 2), "samples": int(n), "pass_at_1": e.value})
    return sorted(out, key=lambda p: (p["step"], p["rl_s"]))


def at(points: list[dict], key: str, limit: float) -> float:
    """pass@1 of the last evaluation whose ``key`` is at most ``limit``."""
    return [p for p in points if p[key] <= limit + 1e-9][-1]["pass_at_1"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=60.0, help="RL wall-clock seconds per mode")
    p.add_argument("--eval-every", type=int, default=3, help="steps between evaluations")
    p.add_argument("--eval-size", type=int, default=32, help="held-out prompts per evaluation")
    p.add_argument("--max-digits", type=int, default=7, help="largest operand (the demo: 6)")
    p.add_argument("--tail-alpha", type=float, default=0.8, help="power-law exponent of operand sizes (the demo: 1.0)")
    p.add_argument("--max-new-tokens", type=int, default=120)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--warmup-steps", type=int, default=300, help="the demo's warm-up")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("overrides", nargs="*", help="more key=value settings for every mode")
    args = p.parse_args()
    modes = args.modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        raise SystemExit(f"--modes: {bad} not in {MODES}")
    if args.budget <= 0 or args.eval_every < 1 or args.eval_size < 1:
        raise SystemExit("--budget must be > 0, --eval-every and --eval-size >= 1")
    G = 8
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            run_dir = Path(tmp) / mode
            cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", str(ROOT / "configs/demo.yaml"),
                   f"model.path={tmp}/model_{mode}", f"train.run_dir={run_dir}", f"rollout.mode={mode}",
                   f"rollout.samples_per_prompt={G}", f"rollout.prompts_per_step={args.prompts_per_step}",
                   f"rollout.max_new_tokens={args.max_new_tokens}", f"engine.max_model_len={args.max_new_tokens + 48}",
                   f"data.max_digits={args.max_digits}", f"data.tail_alpha={args.tail_alpha}",
                   f"data.eval_size={args.eval_size}", f"warmup.steps={args.warmup_steps}",
                   f"train.time_limit_s={args.budget}", "train.steps=1000", f"train.eval_every={args.eval_every}",
                   *args.overrides]
            print(f"[{mode}] {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"{mode} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            results[mode] = curve(run_dir, G)
            print(json.dumps({"mode": mode, "curve": results[mode]}), flush=True)
    before = {m: c[0]["pass_at_1"] for m, c in results.items()}
    if len(set(before.values())) != 1:
        print(f"warning: warm starts differ: pass@1 before RL {before}", file=sys.stderr)
    if not any(before.values()):
        print("warning: pass@1 before RL is 0: the warm start is too weak for a reward signal (more --warmup-steps)",
              file=sys.stderr)
    t_eq = min(c[-1]["rl_s"] for c in results.values())
    n_eq = min(c[-1]["samples"] for c in results.values())
    summary = {m: {"pass_at_1_before": before[m], "final": c[-1], f"pass_at_1_at_{t_eq:.0f}s": at(c, "rl_s", t_eq),
                   f"pass_at_1_at_{n_eq}_samples": at(c, "samples", n_eq)} for m, c in results.items()}
    print(json.dumps({"equal_time_s": t_eq, "equal_samples": n_eq, "modes": summary}))
    for m, s in summary.items():
        print(f"{m}: pass@1 {s['pass_at_1_before']:.3f} → {s['final']['pass_at_1']:.3f} in {s['final']['rl_s']:.0f} s "
              f"({s['final']['samples']} samples); at equal time ({t_eq:.0f} s) "
              f"{s[f'pass_at_1_at_{t_eq:.0f}s']:.3f}; at equal samples ({n_eq}) {s[f'pass_at_1_at_{n_eq}_samples']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
