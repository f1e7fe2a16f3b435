"""Activation recompute (``trainer.recompute``) computes what no recompute computes, at every layout.

At each layout one worker run (tests/workers/recompute_checks.py) builds three packed trainers from the same weights
(none, selective, full) and gives them one optimizer step on the same batch, two rows a micro-batch: the loss, grad
norm and metrics, and the weights after the step agree (fp32: 1e-6 relative); megatron's checkpoint ran (selective:
once per layer and micro-batch; full: once per unit) and nothing did without recompute. MoE trainers replay routes
(R3) that their own routing would not choose, so a recomputed router that routed again or took another micro-batch's
targets (PP: a later micro-batch's forward runs before an earlier one's backward) would change the step; every
recomputed router took its forward's experts back (the taps' queues end empty).

With LoRA (``lora.*``: adapters on the frozen base, dropout 0.1) the same holds for the adapters: full recompute keeps
their gradients although the first stage's input (the frozen embedding's output) needs none, and replays the
forward's dropout masks (without the first, the step's grad norm was 0.28 against 0.51).
"""

import pytest

from helpers.scripts import run_script
from megarl.models.tiny import TinyShape, make_tiny_model

SLOW = pytest.mark.slow
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("recompute")
    return {f: make_tiny_model(root / f, TinyShape(family=f), seed=3) for f in ("qwen2", "qwen3_moe")}


LAYOUTS = [("qwen3_moe", "pp2", ""), ("qwen3_moe", "pp2", "lora"), pytest.param("qwen2", "tp2_sp", "", marks=SLOW),
           pytest.param("qwen2", "pp2", "", marks=SLOW), pytest.param("qwen3_moe", "tp2_sp", "", marks=SLOW),
           pytest.param("qwen3_moe", "pp2_vpp2", "", marks=SLOW),
           pytest.param("qwen3_moe", "ep2_alltoall", "", marks=SLOW),
           pytest.param("qwen2", "dp2", "", marks=SLOW), pytest.param("qwen3_moe", "single", "", marks=SLOW),
           pytest.param("qwen2", "tp2", "lora", marks=SLOW)]


@pytest.mark.parametrize("family,layout,lora", LAYOUTS)
def test_recompute_steps_equal_no_recompute(models, family, layout, lora):
    launcher = [] if layout == "single" else TORCHRUN
    got = run_script([*launcher, "tests/workers/recompute_checks.py", layout, str(models[family]), lora],
                     env={"OMP_NUM_THREADS": "1"})
    assert got["world"] == (1 if layout == "single" else 2)
    assert (got["adapters"] > 0) == bool(lora)
    ref = got["steps"]["none"]
    assert ref["grad_norm"] > 0.01  # (the step moves the weights: not vacuous)
    if family == "qwen3_moe":  # R3: the engine's routes replayed, their agreement with the trainer's own measured once
        assert "moe/route_agreement" in ref and ref["moe/route_agreement"] < 0.5
    for mode in ("selective", "full"):
        step = got["steps"][mode]
        assert step.keys() == ref.keys(), mode
        for key, value in ref.items():
            assert step[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (mode, key)
        assert got["weight_gap"][mode] <= 1e-6, (mode, got["weight_gap"])
        assert got["queued_after"][mode] == 0
    layers, chunks = got["layers_per_chunk"], got["vpp"]
    assert got["checkpoints"]["none"] == 0
    assert got["checkpoints"]["selective"] > 0 and got["checkpoints"]["selective"] % (layers * chunks) == 0
    # selective: once per layer's core attention and micro-batch; full: once per unit of recompute_layers layers
    assert got["checkpoints"]["full"] * got["recompute_layers"] == got["checkpoints"]["selective"]
