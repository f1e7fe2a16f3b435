"""MoE layouts where a pipeline stage or a virtual chunk holds no MoE layer (``mlp_only_layers``): every rank
enters the route metrics' collectives (a stage without routers used to skip the pipeline all-reduce its peers
entered: the run hung), and routing replay is the same as in one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.hf_models import make_hf_model
from helpers.scripts import run_script

TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
ENV = {"OMP_NUM_THREADS": "1"}

# 4 layers. PP 2: stage 0 holds layers 0-1, stage 1 layers 2-3. PP 2 × VPP 2: rank 0 holds layers 0 and 2,
# rank 1 layers 1 and 3. Dense layers in the middle of the stack, so that an MoE layer's column is not its index.
CASES = {
    "pp2": [0, 1],  # stage 0: no MoE layer
    "pp2_vpp2": [1, 3],  # rank 1: no MoE layer in either chunk
}


def _run(tmp_path, layout: str) -> tuple[dict, Path]:
    model = make_hf_model(tmp_path / "model", "qwen2_moe", seed=2, mlp_only_layers=CASES[layout])
    got = run_script([*TORCHRUN, "tests/workers/moe_stage_checks.py", str(model), layout], env=ENV, timeout=240)
    assert [] in got["taps"]  # one rank holds no router
    assert got["received"] == got["taps"]  # R2: each rank receives the routes of its own stage's layers only
    assert got["routes_shape"] == [8, 20, 2, 2] and got["unrouted_in_rows"] == 0  # both columns, every position
    assert got["agreement"] == 1.0 and got["step_agreement"] == 1.0 and got["replay_vs_own_max"] <= 1e-6
    # replay's start-up self-check: passes as built; a router whose tap is out of its slot (as under megatron's
    # fused top-k): refused, the cause named; under full recompute: passes (a recomputed router replays its first
    # call: tests/distributed/test_recompute.py)
    assert got["self_check"] == ""
    assert "router rows were not dispatched to the forced experts" in got["bypassed"], got["bypassed"]
    assert got["recompute"] == "", got["recompute"]
    return got, model


def test_a_stage_without_moe_layers_enters_the_route_metrics(tmp_path):
    _run(tmp_path, "pp2")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2", "pp2_vpp2"])
def test_a_stage_without_moe_layers_replays_as_one_process(tmp_path, layout):
    got, model = _run(tmp_path, layout)
    one = run_script(["tests/workers/moe_stage_checks.py", str(model), "single"], env=ENV, timeout=240)
    assert one["taps"] == [[0, 1]] and got["routes_shape"] == one["routes_shape"]
    assert got["routes_per_column"] == one["routes_per_column"] and got["agreement"] == one["agreement"]
    assert got["step_loss"] == pytest.approx(one["step_loss"], abs=1e-5)
