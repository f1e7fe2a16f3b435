"""trainer.precision=bf16: megatron's mixed precision at each layout against fp32 in one process (real
megatron-core, gloo). bf16 weights and activations with fp32 main params, gradients and Adam state: after a few
PPO steps the loss and grad norm stay within 2% of fp32's and the logprobs within bf16's rounding."""

import json

import pytest
import torch

from helpers.scripts import run_script
from megarl.models.tiny import TinyShape, make_tiny_model

STEPS = 3
SLOW = pytest.mark.slow  # (a 2-process run each: the default run keeps EP 2 with the distributed optimizer)
LAYOUTS = [("qwen3_moe", "bf16_ep2_distopt"), pytest.param("qwen3_moe", "bf16_tp2_sp", marks=SLOW),
           pytest.param("qwen2", "bf16_pp2", marks=SLOW), pytest.param("qwen2", "bf16_dp2_distopt", marks=SLOW)]
_RUNS: dict = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision")
    return {f: make_tiny_model(root / f, TinyShape(family=f), seed=3) for f in ("qwen2", "qwen3_moe")}, root


def run(models, family, layout):
    if (family, layout) not in _RUNS:
        paths, root = models
        out = root / f"{family}-{layout}"
        launcher = [] if layout.startswith(("single", "bf16_single")) else [
            "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        run_script([*launcher, "tests/workers/precision_checks.py", layout, str(paths[family]), str(out), str(STEPS)],
                   env={"OMP_NUM_THREADS": "1"})
        _RUNS[family, layout] = json.loads((out / "result.json").read_text())
    return _RUNS[family, layout]


def assert_near_fp32(ref, got):
    assert len(got["steps"]) == len(ref["steps"]) == STEPS
    for r, g in zip(ref["steps"], got["steps"]):
        assert not g["skipped"]
        assert g["loss"] == pytest.approx(r["loss"], rel=0.02, abs=1e-4)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=0.02)
    a, b, mask = (torch.tensor(x) for x in (ref["logprobs"], got["logprobs"], ref["mask"]))
    gap = (a - b).abs() * mask
    assert gap.sum() / mask.sum() < 0.01  # bf16 rounds to 8 bits of mantissa: logprobs of ~-6 move by ~0.02 at most
    assert gap.max() < 0.1
    assert gap.max() > 0  # bf16 did run: an fp32 run would agree to 1e-5


@pytest.mark.parametrize("family", ["qwen3_moe"])
def test_bf16_keeps_fp32_main_params_and_gradients_and_tracks_fp32(models, family):
    ref, got = run(models, family, "single"), run(models, family, "bf16_single")
    assert ref["model_dtypes"] == ref["main_dtypes"] == ["torch.float32"]
    assert got["model_dtypes"] == ["torch.bfloat16"]
    assert got["main_dtypes"] == ["torch.float32"]  # what Adam updates: the fp32 main params
    assert got["grad_dtypes"] == ["torch.float32"]  # accumulated and reduced in fp32
    assert got["optimizers"] == ["Float16OptimizerWithFloat16Params"]
    assert_near_fp32(ref, got)


@pytest.mark.parametrize("family,layout", LAYOUTS)
def test_bf16_layout_tracks_fp32_one_process(models, family, layout):
    got = run(models, family, layout)
    assert got["model_dtypes"] == ["torch.bfloat16"] and got["main_dtypes"] == ["torch.float32"]
    if "distopt" in layout:
        assert "DistributedOptimizer" in got["optimizers"]  # the fp32 main params sharded over DP
    assert_near_fp32(run(models, family, "single"), got)
