"""Running ``tools/convert_checkpoint.py`` from the tests (the conversion and checkpoint-identity tests share it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import torch

from helpers.scripts import ROOT

TOOL = "tools/convert_checkpoint.py"


def convert(*args, check=True):
    proc = subprocess.run([sys.executable, TOOL, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


def safetensors_bytes(path):
    """name → (dtype, shape, raw bytes) over every shard of an HF directory."""
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                out[name] = (t.dtype, tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return out


def tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fails(tmp_path, capsys, args, *expected):
    """The tool (in this process: these errors come before megatron starts) exits 2 naming the problem."""
    assert tool().main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    for text in expected:
        assert text in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
