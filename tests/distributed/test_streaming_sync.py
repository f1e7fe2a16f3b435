"""Streaming, resharded weight sync with the real parts: megatron-core on gloo (2 processes) → vLLM CPU.

Every layout's trainer streams its weights bucket by bucket into one colocated engine; the engine's
logprobs then equal the trainer's. The peak memory a sync adds, measured as RSS in a subprocess,
stays under a bound set by the bucket and the largest tensor, whatever the depth of the model.
"""

from __future__ import annotations

import pytest

from helpers.scripts import run_script
from megarl.models.tiny import TinyShape, make_tiny_model

LAYOUTS = "tp2_sp,pp2,pp2_vpp2,ep2_alltoall"
DENSE_LAYOUTS = "tp2,pp2_vpp2,dp2"


def run_engine_checks(tmp_path_factory, family: str, layouts: str) -> dict:
    model = make_tiny_model(tmp_path_factory.mktemp("stream") / family, TinyShape(family=family), seed=3)
    out = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                      "tests/workers/streaming_checks.py", "engine", str(model), layouts], env={"OMP_NUM_THREADS": "1"})
    return out["layouts"]


@pytest.fixture(scope="module")
def engine_results(tmp_path_factory):
    return run_engine_checks(tmp_path_factory, "qwen3_moe", LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS.split(","))
def test_engine_logprobs_equal_trainer_after_a_streamed_sync(engine_results, layout):
    for rank, r in enumerate(engine_results[layout]):
        assert r["same_names"] and r["max_diff"] == 0.0, rank  # exactly what the full gather gives
        assert r["gap_stale"] > 1e-3, rank  # the engine really held other weights before
        assert r["gap_after"] <= 1e-4, rank


def test_sync_is_bucketed_layer_by_layer(engine_results):
    for layout, ranks in engine_results.items():
        r = ranks[0]
        assert r["buckets"] > TinyShape().num_layers, layout  # 64 KiB buckets, never the whole model at once
        assert r["bytes"] == engine_results["tp2_sp"][0]["bytes"], layout  # every layout sends the same model
        assert r["peak_extra"] < r["bytes"] / 8, layout


def memory(tmp_path_factory, layers: int) -> dict:
    shape = TinyShape(family="qwen2", hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=2,
                      head_dim=64, num_layers=layers)
    model = make_tiny_model(tmp_path_factory.mktemp(f"mem{layers}") / "model", shape, seed=0)
    return run_script(["tests/workers/streaming_checks.py", "memory", str(model), "4"],
                      env={"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"})


def test_peak_extra_memory_of_a_sync_does_not_grow_with_layers(tmp_path_factory):
    shallow, deep = memory(tmp_path_factory, 2), memory(tmp_path_factory, 16)
    assert deep["model_bytes"] > 150e6 and deep["layers"] == 8 * shallow["layers"]
    bound = 3 * (deep["bucket_bytes"] + deep["largest_tensor"])  # ~31 MB: set by the shapes, not the depth
    for m in (shallow, deep):
        assert m["stream_peak"] < bound, m
        assert m["tracked_peak"] <= m["bucket_bytes"] + m["largest_tensor"], m
        # one process: only what needs a re-layout (the QKV split) is packed, the rest are the trainer's tensors
        assert m["zero_copy_same"] and m["zero_copy_tracked"] < m["largest_tensor"], m  # fc1 is never copied
        assert m["zero_copy_peak"] < m["stream_peak"] / 2, m
    assert deep["gather_peak"] > 0.5 * deep["model_bytes"]  # the old path holds the whole model: RSS sees it


@pytest.mark.slow
def test_dense_model_streams_under_tp_vpp_and_dp(tmp_path_factory):
    for layout, ranks in run_engine_checks(tmp_path_factory, "qwen2", DENSE_LAYOUTS).items():
        for r in ranks:
            assert r["same_names"] and r["max_diff"] == 0.0, layout
            assert r["gap_stale"] > 1e-3 and r["gap_after"] <= 1e-4, layout
