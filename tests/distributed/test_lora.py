"""LoRA adapters on the megatron-core trainer (real megatron-core, gloo; megarl/trainer/lora.py): with B at zero the
logprobs are the base model's exactly, an adapted layer is W x + (alpha / r) · B A x, only the adapters have
gradients and optimizer state (the base frozen in the trainer's precision), and at TP 2, with and without sequence
parallelism, the adapters' gradients after one backward are one process's."""

import json

import pytest
import torch

from helpers.scripts import run_script
from megarl.models.tiny import TinyShape, make_tiny_model

_RUNS: dict = {}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return make_tiny_model(root / "qwen2", TinyShape(family="qwen2"), seed=3), root


def run(model, layout: str, precision: str = "fp32") -> dict:
    if (layout, precision) not in _RUNS:
        path, root = model
        out = root / f"{layout}-{precision}"
        launcher = [] if layout == "single" else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        run_script([*launcher, "tests/workers/lora_checks.py", layout, str(path), str(out), precision],
                   env={"OMP_NUM_THREADS": "1"})
        _RUNS[layout, precision] = json.loads((out / "result.json").read_text())
    return _RUNS[layout, precision]


def test_b_at_zero_is_the_base_model_and_only_adapters_train(model):
    got = run(model, "single")
    assert got["b_zero_gap"] == 0.0  # B = 0: the first step's logprobs are the base model's, exactly
    assert got["adapters_off_gap"] == 0.0  # adapters_off: the base model (the KL reference without a second model)
    assert got["b_random_gap"] > 1e-2  # the adapters act once B moves
    assert got["dense_gap"] < 1e-6  # W x + b + (alpha / r) · B A x, column- and row-parallel layers
    adapters = got["adapter_params"]
    assert 0 < adapters < got["base_params"] / 10
    # nothing of the base reaches DDP's gradient buffer or the optimizer: no main copy, no Adam state
    assert got["trainable"] == got["grad_buffer"] == got["optimizer_params"] == adapters
    assert got["adam_state"] == 2 * adapters
    assert all(any(x != 0 for row in g for x in row) for g in got["grads"].values())  # A and B both get gradients


@pytest.mark.slow  # (a second 1-process run)
def test_bf16_keeps_the_base_in_bf16_with_fp32_main_copies_of_the_adapters_only(model):
    got = run(model, "single", "bf16")
    assert got["base_dtypes"] == ["torch.bfloat16"] and got["optimizer_main_dtypes"] == ["torch.float32"]
    assert got["optimizer_params"] == got["adapter_params"] and got["adam_state"] == 2 * got["adapter_params"]
    assert got["b_zero_gap"] == got["adapters_off_gap"] == 0.0


@pytest.mark.slow  # (a 2-process run each)
@pytest.mark.parametrize("layout", ["tp2", "tp2_sp"])
def test_tensor_parallel_adapter_gradients_are_one_processs(model, layout):
    ref, got = run(model, "single"), run(model, layout)
    assert got["b_zero_gap"] == got["adapters_off_gap"] == 0.0
    assert got["b_random_gap"] == pytest.approx(ref["b_random_gap"], rel=1e-4)
    assert got["trainable"] == got["optimizer_params"] < ref["trainable"]  # this rank's shards: B or A split
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        g, mine = torch.tensor(g), torch.tensor(got["grads"][name])
        assert mine.shape == g.shape, name
        assert float((mine - g).abs().max() / g.abs().max()) < 1e-5, name  # (relative: the gradients are ~1e-3)
