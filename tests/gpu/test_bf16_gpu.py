"""bf16 on a GPU: the vLLM engine with CUDA graphs (``engine.enforce_eager: auto``) in the trainer's process, a bf16
trainer on the device, and the weight sync between them bit for bit (the CPU run of the same worker is
``test_precision_engine.py``)."""

import pytest

from helpers.scripts import run_script
from megarl.models.tiny import TinyShape, make_tiny_model

pytestmark = pytest.mark.gpu


def test_bf16_engine_runs_cuda_graphs_and_takes_the_bf16_trainers_weights_bit_for_bit(tmp_path):
    model = make_tiny_model(tmp_path / "model", TinyShape(family="qwen2"), seed=3)
    out = run_script(["tests/workers/bf16_sync_checks.py", str(model)])
    for precision, r in out.items():
        assert r["eager"] is False, precision  # CUDA graphs, not eager
        assert r["names"] and r["bitwise_equal"] == r["tensors"] > 20, (precision, r)
        assert r["bytes"] == 2 * r["params"] and r["gap"] < 0.05
