"""Every shell script of the project passes shellcheck (following sourced files)."""

import shutil
import subprocess

import pytest

from helpers.scripts import ROOT

SKIP = {".venv", ".git", "runs", "node_modules"}


def shell_scripts() -> list[str]:
    found = []
    for pattern in ("*.sh", "*.sbatch", ".ci/run"):
        for path in ROOT.rglob(pattern) if "/" not in pattern else [ROOT / pattern]:
            if path.is_file() and not SKIP.intersection(path.relative_to(ROOT).parts):
                found.append(str(path.relative_to(ROOT)))
    return sorted(found)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="missing system tool: shellcheck")
def test_every_shell_script_is_shellcheck_clean():
    scripts = shell_scripts()
    assert {"slurm/train.sbatch", "slurm/mpi.sbatch", "examples/tiny_cpu.sh",
            "tests/cluster/slurm_cluster.sh"} <= set(scripts)
    proc = subprocess.run(["shellcheck", "-x", *scripts], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout
