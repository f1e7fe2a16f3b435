"""Dist checkpoints reshard across layouts, optimizer state included (real megatron-core, gloo).

Save after one step at one layout, load at another, take the same second step: the weights
must equal those of the run that never stopped, which needs Adam's moments and step back.
"""

import pytest
import torch

from helpers.hf_models import make_hf_model
from helpers.scripts import run_script
from megarl.models.tiny import TinyShape, make_tiny_model

SLOW = pytest.mark.slow  # (each case is two 2-process runs: the default run keeps MoE's chained case and DP 2 -> 2)
CASES = [
    pytest.param("qwen2", "tp2", "single", marks=SLOW),
    pytest.param("qwen2", "pp2", "single", marks=SLOW),
    pytest.param("qwen3_moe", "pp2_vpp2", "single", marks=SLOW),  # interleaved chunks ('model0', 'model1') into one
    pytest.param("qwen2", "single", "pp2_vpp2", marks=SLOW),
    pytest.param("qwen2", "dp2", "single", marks=SLOW),
    ("qwen3_moe", "ep2_alltoall", "single"),  # the MoE chained-optimizer case (chained_0. prefixes)
    pytest.param("qwen3_moe", "single", "tp2_sp", marks=SLOW),
    pytest.param("qwen3_moe", "tp2_sp_etp1", "single", marks=SLOW),  # experts reduced apart: plain optimizers
    pytest.param("qwen3_moe", "single", "tp2_sp_etp1", marks=SLOW),
    # into the distributed optimizer (DP > 1): Adam's step per parameter, main params from a plain one
    ("qwen2", "dp2", "dp2"),
    pytest.param("qwen2", "single", "dp2", marks=SLOW),
    pytest.param("qwen3_moe", "ep2_alltoall", "ep2_alltoall", marks=SLOW),
    pytest.param("qwen3_moe", "single", "ep2_alltoall", marks=SLOW),  # expert groups unflagged at EP=1
]


def launch(action, layout, model, work):
    prefix = [] if layout == "single" else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    return run_script([*prefix, "tests/workers/checkpoint_checks.py", action, layout, str(model), str(work)],
                      env={"OMP_NUM_THREADS": "1"})


# Qwen2-MoE with dense layers (keys that only some layers have, checkpoint/layer_axis.py): dense1's
# PP=2 second stage holds MoE layers only, so which layers have a dense key is gathered from every rank.
HETEROGENEOUS = [
    ("qwen2_moe_dense1", "ep2_alltoall", "single"),
    ("qwen2_moe_dense1", "single", "pp2"),
    ("qwen2_moe_step2", "single", "ep2_alltoall"),  # into the distributed optimizer
    ("qwen2_moe_step2", "tp2_sp_etp1", "single"),
]


@pytest.mark.parametrize("family,saved_at,loaded_at", CASES)
def test_checkpoint_reshards_with_optimizer_state(tmp_path, family, saved_at, loaded_at):
    model = make_tiny_model(tmp_path / "model", TinyShape(family=family), seed=5)
    reshard(tmp_path, model, saved_at, loaded_at)


@pytest.mark.slow
@pytest.mark.parametrize("spec,saved_at,loaded_at", HETEROGENEOUS)
def test_dense_and_moe_layers_checkpoint_reshards_with_optimizer_state(tmp_path, spec, saved_at, loaded_at):
    reshard(tmp_path, make_hf_model(tmp_path / "model", spec, seed=5), saved_at, loaded_at)


@pytest.mark.parametrize("loaded_at", [pytest.param("single", marks=SLOW), "dp2"])
def test_a_checkpoint_saved_before_any_optimizer_step_resumes(tmp_path, loaded_at):
    """A policy saved during the critic's warm-up (VAPO's value pre-training) has no Adam state: its resume was
    megatron's KeyError 'optimizer.state.exp_avg... not in state dict'. A fresh optimizer is that state."""
    model = make_tiny_model(tmp_path / "model", TinyShape(family="qwen2"), seed=5)
    reshard(tmp_path, model, "single", loaded_at, save="save_unstepped")


def reshard(tmp_path, model, saved_at, loaded_at, save="save"):
    assert launch(save, saved_at, model, tmp_path)["ok"]
    assert (tmp_path / "ckpt" / "metadata.json").is_file() and not (tmp_path / "ckpt.tmp").exists()
    assert launch("load", loaded_at, model, tmp_path)["ok"]
    expected, got = torch.load(tmp_path / "expected.pt"), torch.load(tmp_path / "got.pt")
    assert expected.keys() == got.keys()
    # The second step runs at another layout (other reduction orders): measured up to 2e-6 (Qwen2-MoE saved at
    # TP=2+SP, loaded at one process; the same two steps run through at either layout differ by 4e-4). Adam's
    # moments or step lost in the reshard move a weight by about lr = 1e-3.
    for name in expected:
        assert (expected[name] - got[name]).abs().max() <= 1e-5, name


def test_loading_a_missing_checkpoint_names_the_path(tmp_path):
    from megarl.checkpoint.dist import load_checkpoint

    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_checkpoint(None, tmp_path)


def test_a_save_that_died_between_its_renames_leaves_a_readable_checkpoint(tmp_path):
    from megarl.checkpoint.dist import readable_path

    ckpt = tmp_path / "ckpt"
    (tmp_path / "ckpt.old").mkdir()
    (tmp_path / "ckpt.old" / "metadata.json").write_text("{}")
    assert readable_path(ckpt) == tmp_path / "ckpt.old"  # the old one moved aside, the new one not yet in place
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text("{}")
    assert readable_path(ckpt) == ckpt


def test_keys_only_some_layers_have_pass_megatrons_integrity_check(tmp_path):
    """Qwen2-MoE with a dense layer (``mlp_only_layers``) or every other layer dense
    (``decoder_sparse_step``): megatron stacks each key over all layers, so the router had holes at
    the dense layers and the dense MLP at the MoE ones, and megatron refused every save and load
    ("Invalid access pattern"). Such keys are stored over the layers that have them; a homogeneous
    model's keys stay exactly megatron's (its existing checkpoints still load)."""
    models = {name: str(make_hf_model(tmp_path / name, name, seed=1))
              for name in ("qwen2_moe_dense1", "qwen2_moe_step2", "qwen3_moe")}
    got = run_script(["tests/workers/layer_axis_checks.py", *models.values()], env={"OMP_NUM_THREADS": "1"})["models"]
    dense1, step2, homogeneous = (got[models[n]] for n in models)
    router, fc1 = "decoder.layers.mlp.router.weight", "decoder.layers.mlp.linear_fc1.weight"
    experts = "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight"
    assert dense1["shapes"][router] == [3, 4, 128] and dense1["shapes"][fc1] == [1, 384, 128]
    assert dense1["shapes"][experts][0] == 3  # the optimizer's copy of a factory-built expert weight too
    assert step2["shapes"][router] == [2, 4, 128] and step2["shapes"][fc1] == [2, 384, 128]
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    assert dense1["shapes"][qkv][0] == step2["shapes"][qkv][0] == 4  # keys every layer has: over all layers
    assert homogeneous["as_megatron"] and homogeneous["shapes"][router] == [4, 4, 128]


@pytest.mark.slow
def test_a_run_of_the_tiny_qwen2_moe_saves_and_resumes(tmp_path):
    """``model.make_tiny=qwen2_moe`` (a middle layer dense): ``megarl train`` trained its steps, then died
    at its first checkpoint save and lost the run. Now it saves, and the same command resumes there."""
    import os
    import subprocess
    import sys

    from helpers.scripts import ROOT

    def train(steps):
        proc = subprocess.run(
            [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/tiny_cpu.yaml",
             f"model.path={tmp_path / 'model'}", "model.make_tiny=qwen2_moe", f"train.steps={steps}",
             "warmup.steps=0", f"train.run_dir={tmp_path / 'run'}"],
            cwd=ROOT, capture_output=True, text=True, timeout=900,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        return proc.stdout + proc.stderr

    train(1)
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "policy" / "metadata.json").is_file()
    out = train(2)
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'step_000001'} at step 1" in out
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "policy" / "metadata.json").is_file()
    assert (tmp_path / "run" / "hf" / "step_2" / "config.json").is_file()
