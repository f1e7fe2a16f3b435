"""``trainer.reference_on_host``: the KL reference's weights kept on the host and copied into the policy's model for
its forward (``rl_update.HostReference``) score a batch exactly as a reference model of its own does, and leave the
policy's weights and logprobs bit for bit as they were: a dense model in one process, a tiny MoE's experts at EP 2,
a dense model at PP 2 (each rank swaps its own stage's shards). Real megatron-core on gloo."""

import pytest

from helpers.scripts import run_script
from megarl.models.tiny import TinyShape, make_tiny_model


@pytest.mark.parametrize("family, layout", [("qwen2", "single"),
                                            pytest.param("qwen3_moe", "ep2_alltoall", marks=pytest.mark.slow),
                                            pytest.param("qwen2", "pp2", marks=pytest.mark.slow)])
def test_a_host_reference_scores_as_its_own_model_and_gives_the_policy_back(tmp_path, family, layout):
    model = make_tiny_model(tmp_path / family, TinyShape(family=family), seed=3)
    launcher = [] if layout == "single" else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    r = run_script([*launcher, "tests/workers/host_reference_checks.py", layout, str(model)],
                   env={"OMP_NUM_THREADS": "1"})
    assert r["reference_gap"] == 0.0 and r["policy_gap"] > 0  # the reference's weights ran, not the policy's
    assert r["weights_back"] and r["logprobs_back"]
