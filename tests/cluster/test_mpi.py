"""``mpirun -np 2`` (Debian's Open MPI, mpi4py) runs the tiny config: rank 0's TCPStore port goes to the
other rank by MPI broadcast, and the run is the same loop as under torchrun. Each rank bound to a core of its own
(``--bind-to core``, Open MPI's default at two ranks) keeps it whole."""

import os
import shutil
import subprocess
import sys

import pytest

from helpers.scripts import ROOT


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="missing system tool: mpirun (openmpi-bin)")
def test_mpirun_two_ranks_run_the_tiny_config(tmp_path):
    pytest.importorskip("mpi4py", reason="mpi4py not installed")
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "core", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
           sys.executable, "-m", "megarl.cli", "train", "--config", "configs/tiny_cpu.yaml",
           "engine.tensor_parallel_size=1", "train.steps=2", f"train.run_dir={tmp_path / 'run'}",
           f"model.path={tmp_path / 'model'}"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "HOME": os.environ.get("HOME", "/root")}
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout
    assert "megarl: 2 processes started by mpi, rendezvous " in out  # the bootstrap's MPI path
    # mpirun bound each rank to a core of its own: megarl computes on it rather than splitting it between the ranks
    assert "cpu placement on each rank's own cores, bound by its launcher" in out, out[-3000:]
    assert out.count("step 2/2 |") == 1 and "eval after RL: pass@1" in out
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
