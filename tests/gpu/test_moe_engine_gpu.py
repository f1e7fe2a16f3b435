"""MoE engines on a GPU: routing replay's capture through vLLM's own route output (``enable_return_routed_experts``:
Model Runner V2, CUDA graphs, prefix caching on) through the slot face, aborts and resumes, and preemption
mid-prefill (the CPU runs of the same workers are ``tests/engine/test_routing_replay.py``'s, through the router
hook); an engine sized in bytes starting and restarting beside a trainer that holds half the GPU."""

import pytest

from helpers.hf_models import make_hf_model
from helpers.scripts import run_script
from megarl.models.tiny import TinyShape, make_tiny_model

pytestmark = pytest.mark.gpu


def test_a_gpu_engine_with_cuda_graphs_returns_the_routes_of_every_fed_position(tmp_path):
    model = make_tiny_model(tmp_path / "model", TinyShape(family="qwen3_moe"), seed=3)
    r = run_script(["tests/workers/route_capture_checks.py", str(model), str(tmp_path / "samples.pt"), "bfloat16"])
    assert r["capture"] == "ReturnedRoutes" and r["eager"] is False and r["prefix_caching"] is True
    assert r["samples"] == 8 and r["interrupted"] >= 1 and r["lengths_ok"] and r["kept"]
    assert r["dtype"] == "uint8" and r["shape"] == [4, 2] and 0 <= r["max_id"] < 4


def test_requests_preempted_mid_prefill_on_a_gpu_get_the_routes_of_an_unpreempted_run(tmp_path):
    model = make_hf_model(tmp_path / "model", "qwen2_moe_dense1")
    r = run_script(["tests/workers/route_preemption_checks.py", str(model), "14"])
    assert r["preempted"] >= 1 and r["lengths_ok"] and r["same_tokens"] and r["same_routes"]
    assert r["layers"] == [0, 2, 3] and r["shape"] == [3, 2] and r["prefix_caching"] is True


def test_an_engine_sized_in_bytes_starts_and_restarts_beside_a_trainer_holding_half_the_gpu(tmp_path):
    """vLLM's default share (0.92) would refuse this start: ``kv_cache_args`` asks only for the KV cache's."""
    model = make_tiny_model(tmp_path / "model", TinyShape(family="qwen3_moe"), seed=3)
    r = run_script(["tests/workers/engine_restart_gpu_checks.py", str(model), "0.5"])
    assert r["free_at_start"] < 0.55 and r["share"] < 0.05 and r["kv_bytes"] == 2**28
    assert r["same"] and r["tokens"] == 8
