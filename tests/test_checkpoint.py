"""Dist checkpoints reshard across layouts, optimizer state included (real megatron-core, gloo).

Save after one step at one layout, load at another, take the same second step: the weights
must equal those of the run that never stopped, which needs Adam's moments and step back.
"""

import pytest
import torch

from conftest import run_script
from megarl.models.tiny import TinyShape, make_tiny_model

CASES = [
    ("qwen2", "tp2", "single"),
    ("qwen2", "pp2", "single"),
    ("qwen3_moe", "pp2_vpp2", "single"),  # interleaved chunks ('model0', 'model1') into one model
    ("qwen2", "single", "pp2_vpp2"),
    ("qwen2", "dp2", "single"),
    ("qwen3_moe", "ep2_alltoall", "single"),  # the MoE chained-optimizer case (chained_0. prefixes)
    ("qwen3_moe", "single", "tp2_sp"),
    ("qwen3_moe", "tp2_sp_etp1", "single"),  # experts reduced apart: a chain of plain optimizers
    ("qwen3_moe", "single", "tp2_sp_etp1"),
    # into the distributed optimizer (DP > 1): Adam's step per parameter, main params from a plain one
    ("qwen2", "dp2", "dp2"),
    ("qwen2", "single", "dp2"),
    ("qwen3_moe", "ep2_alltoall", "ep2_alltoall"),
    ("qwen3_moe", "single", "ep2_alltoall"),  # expert groups unflagged at EP=1
]


def launch(action, layout, model, work):
    prefix = [] if layout == "single" else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    return run_script([*prefix, "tests/checkpoint_checks.py", action, layout, str(model), str(work)],
                      env={"OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("family,saved_at,loaded_at", CASES)
def test_checkpoint_reshards_with_optimizer_state(tmp_path, family, saved_at, loaded_at):
    model = make_tiny_model(tmp_path / "model", TinyShape(family=family), seed=5)
    assert launch("save", saved_at, model, tmp_path)["ok"]
    assert (tmp_path / "ckpt" / "metadata.json").is_file() and not (tmp_path / "ckpt.tmp").exists()
    assert launch("load", loaded_at, model, tmp_path)["ok"]
    expected, got = torch.load(tmp_path / "expected.pt"), torch.load(tmp_path / "got.pt")
    assert expected.keys() == got.keys()
    for name in expected:
        assert (expected[name] - got[name]).abs().max() <= 1e-6, name


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
