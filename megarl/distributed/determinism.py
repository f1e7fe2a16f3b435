"""``train.deterministic``: repeatable kernels."""

from __future__ import annotations

import os

import torch


def make_deterministic() -> None:
    """``train.deterministic``: deterministic torch kernels (cuBLAS workspace, no atomics-based
    reductions) on GPU; call before anything runs a kernel. On CPU the run is already repeatable."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
