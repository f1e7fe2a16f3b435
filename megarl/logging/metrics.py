"""TensorBoard scalars under stable names, ``run_dir/metrics.jsonl``, and one console line per step with an ETA.

``metrics.jsonl`` holds one JSON object per ``scalars`` call (``{"step": N, ...}``; the final
evaluation's line also has ``"final": true``). A resumed run first drops the lines past its
checkpoint's step (``resume_at``), so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from megarl.checkpoint.run import write_atomic

log = logging.getLogger(__name__)


# The stable scalar names every RL step that trains the policy writes (dashboards and tests rely on them).
STEP_SCALARS = (
    "reward/mean",
    "reward/pass_rate",
    "response/len_mean",
    "response/len_max",
    "loss/policy",
    "mismatch/kl",
    "timing/gen_s",
    "timing/train_s",
    "timing/sync_s",
    "sync/bytes",
    "sync/buckets",
    "sync/peak_extra_mib",
)

# Scalars measured with the wall clock: they differ between two runs of the same config, so an exact
# (deterministic) resume is compared without them (``deterministic_view``).
WALL_CLOCK = ("timing/", "rollout/bubble_ratio", "rollout/eta_gen", "rollout/tokens_per_s",
              "rollout/useful_tokens_per_s", "pipeline/overlap_fraction", "sync/replica_load_s",
              "sync/replica_update_s", "sync/transfer_s")


def deterministic_view(record: dict) -> dict:
    """``record`` without its wall-clock scalars (``WALL_CLOCK``)."""
    return {k: v for k, v in record.items() if not k.startswith(WALL_CLOCK)}


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl (a line cut short by a kill is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines() if Path(path).is_file() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def final_pass_at_1(path: str | Path) -> float:
    """A finished run's held-out pass@1 after RL: its metrics.jsonl's final evaluation (NaN where it has none)."""
    finals = [r["eval/pass_at_1"] for r in read_metrics(path) if r.get("final") and "eval/pass_at_1" in r]
    return finals[-1] if finals else float("nan")


class MetricsLogger:
    """Writes scalars to TensorBoard (rank 0 only) and prints a progress line per step."""

    def __init__(self, run_dir: str | Path, total_steps: int, enabled: bool = True, stream=sys.stdout,
                 time_limit_s: float = 0.0) -> None:
        self.enabled, self.total, self.stream, self.time_limit_s = enabled, total_steps, stream, time_limit_s
        self.start, self.clock_step = time.time(), 0
        self.writer = None
        self.run_dir = Path(run_dir)
        self.jsonl = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.run_dir / "tb"))
            self.jsonl = open(self.run_dir / "metrics.jsonl", "a")

    def start_fresh(self) -> None:
        """A run that starts from step 0 in a directory an earlier run used: its metrics are dropped."""
        if self.jsonl is not None and (self.run_dir / "metrics.jsonl").stat().st_size:
            self.resume_at(-1)

    def resume_at(self, step: int, finished: bool = False) -> None:
        """Continue a run from its checkpoint at ``step``: drop later metrics.jsonl lines and TB events (and the final
        records, which the run writes again, unless it is ``finished``: then it writes nothing more)."""
        if self.writer is None:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.jsonl.close()
        path = self.run_dir / "metrics.jsonl"
        records = read_metrics(path)
        kept = [r for r in records if r["step"] <= step and (finished or not r.get("final"))]
        dropped = sum(1 for r in records if r["step"] > step and not r.get("final"))
        if dropped and step >= 0:  # steps an earlier attempt logged after its last checkpoint: they run again
            log.info(f"metrics.jsonl: {dropped} lines past step {step} dropped (those steps run again)")
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        self.jsonl = open(path, "a")
        self.writer.close()  # TensorBoard hides the dropped steps' events on purge_step
        self.writer = SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=step + 1)

    def reset_clock(self, from_step: int = 0) -> None:
        """Start the ETA clock now, at ``from_step`` (call when the stepped phase begins: a resumed run's
        first step is its checkpoint's, and its pace is that of the steps this process ran)."""
        self.start, self.clock_step = time.time(), from_step

    def scalars(self, step: int, values: dict[str, float], final: bool = False) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            self.writer.add_scalar(name, float(value), step)
        self.writer.flush()
        record = {"step": step, **{k: float(v) for k, v in values.items()}, **({"final": True} if final else {})}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        os.fsync(self.jsonl.fileno())

    def histogram(self, step: int, name: str, counts: dict[int, int]) -> None:
        """A TensorBoard histogram from value → count (e.g. staleness in versions → tokens)."""
        if self.writer is None or not counts:
            return
        import numpy as np

        values = np.repeat(np.array(list(counts.keys()), dtype=np.float64), list(counts.values()))
        self.writer.add_histogram(name, values, step, bins="auto")

    def progress(self, step: int, values: dict[str, float], keys: tuple[str, ...]) -> None:
        """``step 3/20 | reward/mean 0.41 | ... | eta 1m12s`` (steps are 1-based here)."""
        if not self.enabled:
            return
        elapsed = time.time() - self.start
        eta = elapsed / max(step - self.clock_step, 1) * max(self.total - step, 0)
        if self.time_limit_s:
            eta = min(eta, max(self.time_limit_s - elapsed, 0.0))
        parts = [f"step {step}/{self.total}"] + [f"{k} {values[k]:.4g}" for k in keys if k in values]
        parts.append(f"elapsed {_fmt(elapsed)} eta {_fmt(eta)}")
        print(" | ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.jsonl.close()


def _fmt(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s"
