#!/usr/bin/env python
"""End-to-end value of SortedRL: pass@1 reached by sync, on-policy and partial rollout in the same wall budget.

Runs the demo's task (``configs/demo.yaml``: GRPO on the tiny Qwen3-MoE, addition
with a scratchpad) once per mode from one warm start: the supervised warm-up runs
once (``train.steps=0``), its policy is exported as an HF checkpoint, and every mode
starts RL from that checkpoint with the same seed (the script checks that pass@1
before RL agrees). The setting is generation-heavy: a longer length tail than the
demo (operands up to ``--max-digits`` digits, a flatter power law, a longer length
cap), so that generation dominates the step (the share is printed). Otherwise the
demo's recipe: 32 prompts × 8 samples per step, cosine decay over 150 steps, but a lower
peak learning rate (``--lr``, default ``LR``; the floor is a tenth of it): at the demo's
1e-3 (floor 1e-4) RL collapsed from this warm start in every mode (pass@1 0.12 → 0.00
within 10 steps; 16 prompts per step at a constant 1e-3 did the same), while short sync
probes at 3e-4 and 1e-4 improved steadily (see the README's SortedRL section). Every
mode gets the same wall-clock budget for RL (``train.time_limit_s``) and is evaluated
(greedy pass@1 on held-out prompts) every ``--eval-every`` steps.

Side by side: the modes run at the same time, one process each, so the load of a
shared machine falls on all of them alike (``--sequential`` runs them one after the
other, for a quiet machine).

Prints one JSON line per mode with its curve (step, RL seconds, trained samples,
pass@1), then pass@1 at equal time (the RL seconds the slowest mode reached: the
last evaluation at or before it) and at equal samples (likewise, in trained
samples), per mode. RL seconds count generation + training + weight sync, not the
evaluations.

    .venv/bin/python bench/time_to_accuracy.py [--budget 600] [--eval-every 5]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("sync", "on_policy", "partial")
LR = 1e-4
"""Peak RL learning rate of every mode (cosine to LR / 10 over 150 steps): the demo's 1e-3 collapses here."""


def curve(run_dir: Path, group_size: int) -> tuple[list[dict], float]:
    """(step, RL seconds, trained samples, pass@1) at every evaluation, from the run's TensorBoard events; and
    the share of the RL seconds spent generating."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    per_step: dict[int, dict] = {}
    for tag in ("timing/gen_s", "timing/train_s", "timing/sync_s", "rollout/groups_released"):
        for e in acc.Scalars(tag) if tag in acc.Tags()["scalars"] else []:
            per_step.setdefault(e.step, {})[tag] = e.value
    seconds = samples = gen = 0.0
    clock = {0: (0.0, 0.0)}
    for step in sorted(per_step):
        d = per_step[step]
        seconds += d.get("timing/gen_s", 0.0) + d.get("timing/train_s", 0.0) + d.get("timing/sync_s", 0.0)
        gen += d.get("timing/gen_s", 0.0)
        samples += d.get("rollout/groups_released", 0.0) * group_size
        clock[step] = (seconds, samples)
    out = []
    for e in acc.Scalars("eval/pass_at_1"):
        s, n = clock.get(e.step, clock[max(k for k in clock if k <= e.step)])
        out.append({"step": e.step, "rl_s": round(s, 2), "samples": int(n), "pass_at_1": e.value})
    return sorted(out, key=lambda p: (p["step"], p["rl_s"])), gen / max(seconds, 1e-9)


def at(points: list[dict], key: str, limit: float) -> float:
    """pass@1 of the last evaluation whose ``key`` is at most ``limit``."""
    return [p for p in points if p[key] <= limit + 1e-9][-1]["pass_at_1"]


STARTED: list[subprocess.Popen] = []


def train(args_list: list[str], log: Path) -> subprocess.Popen:
    """``megarl train`` on the demo config with these overrides, its output to ``log``."""
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", str(ROOT / "configs/demo.yaml"), *args_list]
    print(" ".join(cmd[2:]), file=sys.stderr, flush=True)
    with open(log, "w") as out:
        STARTED.append(subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True))
    return STARTED[-1]


def kill_all() -> None:
    """The bench stopped (an error, Ctrl-C, SIGTERM): its runs stop with it (SIGKILL: no checkpoint wanted)."""
    for p in STARTED:
        if p.poll() is None:
            p.kill()


def on_sigterm(*_) -> None:
    raise SystemExit("time_to_accuracy: stopped by SIGTERM")


def wait(procs: dict[str, tuple[subprocess.Popen, Path]], every: float = 60.0) -> None:
    """Wait for every run, printing each one's last output line now and then; a failed run stops the bench."""
    while True:
        for m, (p, log) in procs.items():
            if p.poll() not in (None, 0):
                tail = log.read_text(errors="replace").splitlines()[-40:]
                raise SystemExit(f"{m} failed ({p.returncode}):\n" + "\n".join(tail))
        running = [(m, p, log) for m, (p, log) in procs.items() if p.poll() is None]
        if not running:
            return
        try:
            running[0][1].wait(timeout=every)
        except subprocess.TimeoutExpired:
            for m, _p, log in running:
                lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
                print(f"[{m}] {lines[-1][:160] if lines else '(starting)'}", file=sys.stderr, flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=600.0, help="RL wall-clock seconds per mode")
    p.add_argument("--eval-every", type=int, default=5, help="steps between evaluations")
    p.add_argument("--eval-size", type=int, default=100, help="held-out prompts per evaluation")
    p.add_argument("--max-digits", type=int, default=7, help="largest operand (the demo: 6)")
    p.add_argument("--tail-alpha", type=float, default=0.8, help="power-law exponent of operand sizes (the demo: 1.0)")
    p.add_argument("--max-new-tokens", type=int, default=192, help="the length cap (the demo: 80)")
    p.add_argument("--prompts-per-step", type=int, default=32, help="the demo's")
    p.add_argument("--warmup-steps", type=int, default=300, help="the demo's warm-up")
    p.add_argument("--lr", type=float, default=LR, help="peak RL learning rate, cosine to a tenth (the demo: 1e-3)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--sequential", action="store_true", help="one mode after the other (a quiet machine)")
    p.add_argument("overrides", nargs="*", help="more key=value settings for every mode")
    args = p.parse_args()
    modes = args.modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        raise SystemExit(f"--modes: {bad} not in {MODES}")
    if args.budget <= 0 or args.eval_every < 1 or args.eval_size < 1 or args.warmup_steps < 0 or args.lr <= 0:
        raise SystemExit("--budget and --lr must be > 0, --eval-every and --eval-size >= 1, --warmup-steps >= 0")
    G = 8
    task = [f"rollout.samples_per_prompt={G}", f"rollout.prompts_per_step={args.prompts_per_step}",
            f"rollout.max_new_tokens={args.max_new_tokens}", f"engine.max_model_len={args.max_new_tokens + 48}",
            f"data.max_digits={args.max_digits}", f"data.tail_alpha={args.tail_alpha}",
            f"data.eval_size={args.eval_size}", f"optim.lr={args.lr}", f"optim.min_lr={args.lr / 10}",
            *args.overrides]
    results, gen_share = {}, {}
    signal.signal(signal.SIGTERM, on_sigterm)
    with tempfile.TemporaryDirectory() as tmp:
        warm = Path(tmp) / "warm"  # the one warm start: the supervised warm-up, exported as an HF checkpoint
        proc = train([f"model.path={tmp}/model", f"train.run_dir={warm}", f"warmup.steps={args.warmup_steps}",
                      "train.steps=0", *task], Path(tmp) / "warm.log")
        try:
            wait({"warm-up": (proc, Path(tmp) / "warm.log")})
            warm_pass = re.findall(r"eval before RL: pass@1 ([0-9.]+)", (Path(tmp) / "warm.log").read_text())
            if warm_pass and float(warm_pass[-1]) == 0.0:
                raise SystemExit("the warm start solves none of the held-out prompts (pass@1 0): RL would get no "
                                 "reward signal; use more --warmup-steps or a smaller --max-digits")
            procs = {}
            for mode in modes:
                log = Path(tmp) / f"{mode}.log"
                procs[mode] = (train([f"model.path={warm}/hf/step_0", f"train.run_dir={tmp}/{mode}",
                                      f"rollout.mode={mode}", "warmup.steps=0", f"train.time_limit_s={args.budget}",
                                      "train.steps=150",
                                      f"train.eval_every={args.eval_every}", *task], log), log)
                if args.sequential:
                    wait({mode: procs.pop(mode)})
            wait(procs)
        except BaseException:
            kill_all()
            raise
        for mode in modes:
            results[mode], gen_share[mode] = curve(Path(tmp) / mode, G)
            print(json.dumps({"mode": mode, "generation_share": round(gen_share[mode], 3), "curve": results[mode]}),
                  flush=True)
    before = {m: c[0]["pass_at_1"] for m, c in results.items()}
    if len(set(before.values())) != 1:
        print(f"warning: warm starts differ: pass@1 before RL {before}", file=sys.stderr)
    if not any(before.values()):
        print("warning: pass@1 before RL is 0: the warm start is too weak for a reward signal (more --warmup-steps)",
              file=sys.stderr)
    t_eq = min(c[-1]["rl_s"] for c in results.values())
    n_eq = min(c[-1]["samples"] for c in results.values())
    summary = {m: {"pass_at_1_before": before[m], "final": c[-1], f"pass_at_1_at_{t_eq:.0f}s": at(c, "rl_s", t_eq),
                   f"pass_at_1_at_{n_eq}_samples": at(c, "samples", n_eq), "generation_share": gen_share[m]}
               for m, c in results.items()}
    print(json.dumps({"equal_time_s": t_eq, "equal_samples": n_eq, "modes": summary}))
    for m, s in summary.items():
        print(f"{m}: pass@1 {s['pass_at_1_before']:.3f} → {s['final']['pass_at_1']:.3f} in {s['final']['rl_s']:.0f} s "
              f"({s['final']['samples']} samples, step {s['final']['step']}, {s['generation_share']:.0%} generating); "
              f"at equal time ({t_eq:.0f} s) {s[f'pass_at_1_at_{t_eq:.0f}s']:.3f}; "
              f"at equal samples ({n_eq}) {s[f'pass_at_1_at_{n_eq}_samples']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
