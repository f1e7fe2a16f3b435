"""TensorBoard scalars under stable names, and one console line per step with an ETA."""

from __future__ import annotations

import sys
import time
from pathlib import Path

# The stable scalar names every run writes (dashboards and tests rely on them).
STEP_SCALARS = (
    "reward/mean",
    "reward/pass_rate",
    "response/len_mean",
    "response/len_max",
    "loss/policy",
    "timing/gen_s",
    "timing/train_s",
    "timing/sync_s",
    "sync/bytes",
    "sync/buckets",
    "sync/peak_extra_mib",
)


class MetricsLogger:
    """Writes scalars to TensorBoard (rank 0 only) and prints a progress line per step."""

    def __init__(self, run_dir: str | Path, total_steps: int, enabled: bool = True, stream=sys.stdout,
                 time_limit_s: float = 0.0) -> None:
        self.enabled, self.total, self.stream, self.time_limit_s = enabled, total_steps, stream, time_limit_s
        self.start = time.time()
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tb"))

    def reset_clock(self) -> None:
        """Start the ETA clock now (call when the stepped phase begins)."""
        self.start = time.time()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            self.writer.add_scalar(name, float(value), step)
        self.writer.flush()

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
        eta = elapsed / max(step, 1) * max(self.total - step, 0)
        if self.time_limit_s:
            eta = min(eta, max(self.time_limit_s - elapsed, 0.0))
        parts = [f"step {step}/{self.total}"] + [f"{k} {values[k]:.4g}" for k in keys if k in values]
        parts.append(f"elapsed {_fmt(elapsed)} eta {_fmt(eta)}")
        print(" | ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _fmt(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s"
