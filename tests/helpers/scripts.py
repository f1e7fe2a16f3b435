"""Running a worker script (tests/workers/) in a fresh interpreter: megatron-core and vLLM keep process-global
state, so each real-stack check runs in a process of its own, and prints one JSON object as its last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def worker_env(env: dict | None = None) -> dict:
    """The environment a worker runs in: tests/ on PYTHONPATH (``helpers.*``, the test reward functions in
    ``helpers.reward_fns``, for the worker and every process it starts), two OpenMP threads unless told."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "PYTHONPATH": path, **(env or {})}


def run_script(args: list[str], timeout: int = 900, env: dict | None = None) -> dict:
    """Run a worker script in a fresh interpreter; it prints one JSON object as its last line."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=worker_env(env))
    if proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    last = [line for line in proc.stdout.splitlines() if line.startswith("{")][-1]
    return json.loads(last)
