"""The calculator example end to end, both arms, one table: where a tool matters.

For each arm, from the same tiny random model (``model.make_tiny: qwen2``, seed 0): a supervised warm-up of the
same budget, held-out greedy pass@1, GRPO, pass@1 again.

- ``tool``: ``config.yaml`` as it is: the warm-up's episodes call ``multiply`` and copy its result, RL runs the
  built-in ``<tool_call>`` environment (``env.fn: tools``), pass@1 plays whole episodes with it.
- ``no tool``: the same with ``env.fn=''`` and the direct-answer warm-up (the product at once).

    .venv/bin/python examples/calculator/run.py                  # data, both arms, the table
    .venv/bin/python examples/calculator/run.py train.steps=10   # any key=value goes to both arms

It prints the table and writes it as ``results.json`` in ``--out``; each arm's run directory (TensorBoard,
``metrics.jsonl``) is ``--out``/``tool`` and ``--out``/``direct``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

from make_dataset import main as make_dataset  # noqa: E402  (this folder's script)


def arms(out: Path) -> dict[str, list[str]]:
    """Each arm's overrides of ``config.yaml``: its warm-up file, its environment, its run directory."""
    data, common = out / "data", [f"model.path={out / 'model'}", f"data.path={out / 'data/train.jsonl'}",
                                  f"data.eval_path={out / 'data/test.jsonl'}", "train.resume=never"]
    return {"tool": [*common, f"warmup.path={data / 'warmup_tool.jsonl'}", f"train.run_dir={out / 'tool'}"],
            "no tool": [*common, "env.fn=", "env.tools=", f"warmup.path={data / 'warmup_direct.jsonl'}",
                        f"train.run_dir={out / 'direct'}"]}


def figures(run_dir: Path, seconds: float) -> dict:
    """pass@1 before and after RL, the RL steps, and the tool's use, from the run's ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "reward/mean" in r]
    evals = [r["eval/pass_at_1"] for r in rows if "eval/pass_at_1" in r]
    return {"pass_at_1_before": evals[0], "pass_at_1_after": evals[-1] if len(evals) > 1 else float("nan"),
            "rl_steps": len(steps), "reward_first": steps[0]["reward/mean"] if steps else float("nan"),
            "reward_last": steps[-1]["reward/mean"] if steps else float("nan"),
            "tool_calls": sum(r.get("rollout/tool_calls", 0.0) for r in steps),
            "turns_mean_last": steps[-1].get("rollout/turns_mean", 1.0) if steps else float("nan"),
            "seconds": round(seconds, 1)}


def table(results: dict) -> str:
    lines = [f"{'arm':<8} {'pass@1 before RL':>16} {'after RL':>9} {'RL steps':>9} {'turns/sample':>13} "
             f"{'minutes':>8}"]
    for arm, r in results.items():
        lines.append(f"{arm:<8} {r['pass_at_1_before']:>16.3f} {r['pass_at_1_after']:>9.3f} {r['rl_steps']:>9} "
                     f"{r['turns_mean_last']:>13.2f} {r['seconds'] / 60:>8.1f}")
    gap = results["tool"]["pass_at_1_after"] - results["no tool"]["pass_at_1_after"]
    lines.append(f"tool - no tool, after RL: {gap:+.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/calculator", help="where the data, the model and both runs go")
    parser.add_argument("--train", type=int, default=4000, help="training problems (make_dataset.py --train)")
    parser.add_argument("--test", type=int, default=200, help="held-out problems (make_dataset.py --test)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for both arms (after the arm's own)")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()  # (the runs start in the repository's root)
    make_dataset(["--out", str(out / "data"), "--train", str(args.train), "--test", str(args.test)])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    results, start = {}, time.time()
    for arm, overrides in arms(out).items():
        began = time.time()
        cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", str(HERE / "config.yaml"), *overrides,
               *args.overrides]
        print(f"== {arm}: {' '.join(cmd[3:])}", flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
        results[arm] = figures(Path(overrides[-1].split("=", 1)[1]), time.time() - began)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"both arms: {(time.time() - start) / 60:.1f} min; {out / 'results.json'}", flush=True)
    return results


if __name__ == "__main__":
    main()
