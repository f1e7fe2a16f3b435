"""megarl's console (``megarl/logging/console.py``) in a fresh process, as a run's rank 0 has it: a library's
root-level ``logging.debug(...)`` (vLLM's CPU MoE kernel makes one on AMD hosts) must not print every megarl line
a second time; other libraries' warnings still reach stderr, once."""

from __future__ import annotations

import subprocess
import sys

from helpers.scripts import ROOT

PROBE = """
import logging
from megarl.logging.console import configure
configure()
logging.debug("a library's probe on the root logger")  # runs logging.basicConfig() where root has no handler
logging.getLogger("megarl.keeper").info("checkpoint saved")
logging.getLogger("megarl.keeper").warning("a megarl warning")
logging.getLogger("somelib").warning("a library's warning")
logging.getLogger("somelib").info("a library's info")
"""


def test_a_root_level_log_call_prints_no_megarl_line_twice():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["checkpoint saved"], out.stdout
    assert out.stderr.splitlines() == ["a megarl warning", "a library's warning"], out.stderr
