"""MoE engines on a GPU: routing replay's capture through vLLM's own route output (``enable_return_routed_experts``:
Model Runner V2, CUDA graphs, prefix caching on) through the slot face, aborts and resumes, and preemption
mid-prefill (the CPU runs of the same workers are ``tests/engine/test_routing_replay.py``'s, through the router
hook); an engine sized in bytes starting and restarting beside a trainer that holds half the GPU; a colocated
engine of TP 2 over two GPUs, whose first rank returns the routes (routing replay on at every colocated layout)."""

import sys

import pytest
import torch

from helpers.hf_models import make_hf_model
from helpers.runs import train
from helpers.scripts import run_script
from megarl.logging.metrics import read_metrics
from megarl.models.tiny import TinyShape, make_tiny_model

pytestmark = pytest.mark.gpu
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="gpu: engine TP 2 needs two GPUs")


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


@TWO_GPUS
def test_a_colocated_engine_of_tp2_returns_the_routes_on_its_first_rank_and_runs_on_the_other(tmp_path):
    """Every rank of the engine runs vLLM's scheduler (``external_launcher``); the second one, which gets no route
    rows, would fail its first step without ``compat.vllm.routes_on_first_tp_rank``."""
    model = make_tiny_model(tmp_path / "model", TinyShape(family="qwen3_moe"), seed=3)
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    "tests/workers/route_capture_checks.py", str(model), str(tmp_path / "samples.pt"), "bfloat16", "2"])
    assert r["tp"] == 2 and r["capture"] == "ReturnedRoutes" and r["prefix_caching"] is True
    assert r["routed"] == [8, 0] and r["same_tokens"] and r["same_generated"]  # the first rank's samples carry them
    assert r["samples"] == 8 and r["interrupted"] >= 1 and r["lengths_ok"] and r["kept"]
    assert r["dtype"] == "uint8" and r["shape"] == [4, 2] and 0 <= r["max_id"] < 4


@TWO_GPUS
def test_a_run_with_a_colocated_engine_of_tp2_replays_the_engines_routes(tmp_path):
    run = tmp_path / "run"
    out = train([sys.executable, "-m", "megarl.cli", "train", "--config", "configs/tiny_cpu.yaml", "--nproc", "2",
                 f"model.path={tmp_path / 'model'}", f"train.run_dir={run}", "engine.tensor_parallel_size=2",
                 "trainer.precision=bf16", "train.steps=3"], run)
    assert "resolves to none" not in out
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "loss/policy" in r]
    assert len(steps) == 3 and all(0.5 < r["moe/route_agreement"] <= 1.0 for r in steps)


def test_a_lora_run_with_expert_adapters_serves_each_new_version_through_vllms_fused_moe_lora(tmp_path):
    """Adapters on attention and every routed expert: the engine takes each sync's adapters into its fused-MoE LoRA
    layer (Triton, the GPU's kernel) and the audit, every step, finds the engine's logprobs the trainer's."""
    make_tiny_model(tmp_path / "model", TinyShape(family="qwen3_moe"), seed=3)
    run = tmp_path / "run"
    train([sys.executable, "-m", "megarl.cli", "train", "--config", "configs/tiny_cpu.yaml",
           f"model.path={tmp_path / 'model'}", f"train.run_dir={run}", "trainer.precision=fp32", "train.steps=3",
           "lora.rank=8", "lora.alpha=16", "lora.targets=linear_qkv,linear_proj,experts", "sync.check_every=1"], run)
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "loss/policy" in r]
    assert len(steps) == 3 and all(r["sync/failures"] == 0 for r in steps if "sync/failures" in r)
    audits = [r["sync/logprob_gap"] for r in steps if "sync/logprob_gap" in r]
    assert len(audits) == 3 and max(audits) < 1e-2  # fp32 (attention adapters on CPU engines: ≤ 2e-5)
    assert [r["engine/version"] for r in steps if "engine/version" in r][-1] >= 2  # each new version served
