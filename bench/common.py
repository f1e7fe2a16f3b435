"""What the benches share: the host's CPU as ``lscpu`` names it (printed beside the figures, which depend on it), and
a measurement run in a fresh process of its own (its memory and state clean)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def host() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown"


def run_child(script: str, *args) -> dict:
    """``script --child ARGS`` in a fresh interpreter (the repository on its path): the last JSON line it prints;
    SystemExit with its stderr's tail when it fails."""
    cmd = [sys.executable, script, "--child", *map(str, args)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if out.returncode:
        raise SystemExit(f"{Path(script).name} --child {' '.join(map(str, args))} failed:\n{out.stderr[-4000:]}")
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
