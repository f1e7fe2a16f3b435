"""The host's CPU as ``lscpu`` names it: what a bench prints beside its figures (the results depend on it)."""

from __future__ import annotations

import subprocess


def host() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown"
