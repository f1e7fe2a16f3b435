"""Every parallel layout computes what one process computes (real megatron-core, gloo, 2 processes).

For each layout and tiny model: the loss and per-token logprobs of a fixed batch, the grad
norm of one PPO step, and the full weights after that step equal the single-process run.
"""

import json

import pytest
import torch

from conftest import run_script
from megarl.models.tiny import TinyShape, make_tiny_model

LAYOUTS = [
    ("qwen2", "tp2"), ("qwen2", "tp2_sp"), ("qwen2", "tp2_full_logits"), ("qwen2", "pp2"), ("qwen2", "pp2_vpp2"),
    ("qwen2", "dp2"), ("qwen3_moe", "pp2_vpp2"),
    ("qwen3_moe", "tp2_sp"), ("qwen3_moe", "tp2_sp_etp1"), ("qwen3_moe", "pp2"), ("qwen3_moe", "dp2"),
    ("qwen3_moe", "ep2_alltoall"), ("qwen3_moe", "ep2_allgather"),
    ("mixtral", "ep2_alltoall"), ("qwen2_moe", "tp2_sp"), ("qwen2_moe", "ep2_allgather"), ("qwen2_moe", "pp2"),
]
_RUNS: dict = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    return {f: make_tiny_model(root / f, TinyShape(family=f), seed=3) for f in ("qwen2", "qwen3_moe", "mixtral", "qwen2_moe")}, root


def run(models, family, layout, head="lm"):
    key = (family, layout, head)
    if key not in _RUNS:
        paths, root = models
        out = root / f"{family}-{layout}-{head}"
        launcher = [] if layout.startswith("single") else ["-m", "torch.distributed.run", "--standalone",
                                                  "--nproc-per-node=2"]
        run_script([*launcher, "tests/parallel_checks.py", layout, str(paths[family]), str(out), head],
                   env={"OMP_NUM_THREADS": "1"})
        _RUNS[key] = (json.loads((out / "result.json").read_text()), torch.load(out / "weights.pt"))
    return _RUNS[key]


def assert_same(ref, got, moved_from=None):
    (r, rw), (g, gw) = ref, got
    assert g["loss"] == pytest.approx(r["loss"], rel=1e-5)
    assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    a, b, mask = torch.tensor(r["logprobs"]), torch.tensor(g["logprobs"]), torch.tensor(r["mask"])
    assert a.shape == b.shape
    assert ((a - b).abs() * mask).max() <= 1e-5 * (a.abs() * mask).max()
    assert rw.keys() == gw.keys()
    for name in rw:
        assert (gw[name] - rw[name]).abs().max() <= 1e-5 * rw[name].abs().max().clamp(min=1e-3), name


@pytest.mark.parametrize("family,layout", LAYOUTS)
def test_layout_matches_single_process(models, family, layout):
    got = run(models, family, layout)
    assert got[0]["world"] == 2
    assert_same(run(models, family, "single"), got)


def test_one_step_moves_the_weights(models):
    from safetensors.torch import load_file

    from megarl.weight_sync.hf_adapter import hf_to_megatron

    paths, _ = models
    cfg = json.loads((paths["qwen2"] / "config.json").read_text())
    before = hf_to_megatron(load_file(str(paths["qwen2"] / "model.safetensors")), cfg)
    _, after = run(models, "qwen2", "single")
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert 5e-6 < moved < 1e-4  # one Adam step of lr 1e-5: the match above is not vacuous


@pytest.mark.parametrize("layout", ["tp2_sp", "pp2", "pp2_vpp2"])
def test_critic_forward_backward_matches_single_process(models, layout):
    ref = run(models, "qwen2", "single", head="value")
    got = run(models, "qwen2", layout, head="value")
    assert ref[0]["head"] == "value" and any(k.startswith("output_layer.") for k in ref[1])
    assert_same(ref, got)




def test_padding_microbatches_do_not_dilute_the_metrics(models):
    ref, got = run(models, "qwen2", "single_mbs8"), run(models, "qwen2", "pp2_vpp2_mbs8")
    assert_same(ref, got)
    for key in ("clip_frac", "ratio_mean", "approx_kl"):
        assert got[0]["metrics"][key] == pytest.approx(ref[0]["metrics"][key], rel=1e-5), key


@pytest.mark.parametrize("layout", ["single_aux_loss", "single_z_loss"])
def test_router_losses_train_the_router_without_changing_the_logprobs(models, layout):
    (plain, plain_w), (routed, routed_w) = run(models, "qwen3_moe", "single"), run(models, "qwen3_moe", layout)
    assert routed["logprobs"] == plain["logprobs"]  # aux and z losses add gradients, not outputs
    router = [k for k in plain_w if k.endswith("mlp.router.weight")]
    assert router and max(float((routed_w[k] - plain_w[k]).abs().max()) for k in router) > 1e-6


@pytest.mark.slow
def test_pipeline_times_data_parallel_logprobs_keep_every_rank_rows(models):
    """EP=2 × PP=2 on four processes (DP=2), one microbatch per DP rank padded for the pipeline: the logprobs
    are every DP rank's rows, not the first rank's rows and its padding (equal to one process's)."""
    paths, root = models
    out = root / "qwen3_moe-ep2_pp2_mbs8"
    run_script(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "tests/parallel_checks.py",
                "ep2_pp2_mbs8", str(paths["qwen3_moe"]), str(out)], env={"OMP_NUM_THREADS": "1"})
    got = (json.loads((out / "result.json").read_text()), torch.load(out / "weights.pt"))
    assert got[0]["world"] == 4 and got[0]["dp"] == 2 and got[0]["pp"] == 2
    assert_same(run(models, "qwen3_moe", "single_mbs8"), got)
