"""Shared fixtures and markers.

Markers: ``gpu`` (needs CUDA; skipped here), ``slow`` (long; run with ``-m slow``).
Engine and distributed tests run their real stack in a subprocess, one per model
or layout, because megatron-core and vLLM keep process-global state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")
    config.addinivalue_line("markers", "slow: long-running; selected with -m slow")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_script(args: list[str], timeout: int = 900, env: dict | None = None) -> dict:
    """Run a helper script in a fresh interpreter; it prints one JSON object as its last line."""
    full_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), **(env or {})}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)
    if proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    last = [line for line in proc.stdout.splitlines() if line.startswith("{")][-1]
    return json.loads(last)
