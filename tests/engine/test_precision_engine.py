"""trainer.precision=bf16 with real vLLM CPU engines: the weight sync into a bfloat16 engine is exact, a bf16 run
checkpoints its fp32 main params and resumes exactly after kill -9, and a resume in the other precision is
refused before launch."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from helpers.runs import tiny_partial_run, train
from helpers.scripts import ROOT, run_script
from megarl.logging.metrics import deterministic_view, read_metrics

STEPS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megarl.models.tiny import TinyShape, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("bf16") / "model", TinyShape(family="qwen2"), seed=3)


def _args(model, run_dir, *extra):
    return tiny_partial_run(model, run_dir, STEPS, "trainer.precision=bf16", "sync.check_every=1",
                           "algo.entropy_coef=0.01", *extra)  # (entropy: the weights move with reward 0 too)


@pytest.fixture(scope="module")
def baseline(model, tmp_path_factory):
    run = tmp_path_factory.mktemp("bf16-run") / "run"
    train(_args(model, run), run)
    return run, read_metrics(run / "metrics.jsonl")


def test_sync_into_a_bf16_engine_is_bit_exact_and_sends_half_the_bytes(model):
    out = run_script(["tests/workers/bf16_sync_checks.py", str(model)], env={"OMP_NUM_THREADS": "1"})
    for precision, r in out.items():  # a bf16 trainer's weights as they are; an fp32 trainer's rounded to bf16
        assert r["names"] and r["bitwise_equal"] == r["tensors"] > 20, (precision, r)
        assert r["bucket_dtype"] == "torch.bfloat16"
        assert r["bytes"] == 2 * r["params"]  # what an fp32 engine is sent: 4 bytes a parameter
        assert r["gap"] < 0.05  # trainer and engine logprobs of the same bf16 weights, through different kernels
        assert r["eager"] is True  # engine.enforce_eager=auto on CPU (no CUDA graphs to capture)
    assert out["bf16"]["trainer_dtypes"] == ["torch.bfloat16"] and out["fp32"]["trainer_dtypes"] == ["torch.float32"]


def test_a_bf16_run_checkpoints_fp32_main_params_and_its_engine_tracks_the_trainer(baseline):
    from megatron.core import dist_checkpointing

    run, records = baseline
    steps = [r for r in records if "sync/bytes" in r]
    assert len(steps) == STEPS and all(r["sync/logprob_gap"] < 0.1 for r in steps)
    assert any(r.get("loss/grad_norm", 0) > 0 for r in records), "the run must move its weights"
    policy = run / "checkpoints" / f"step_{STEPS:06d}" / "policy"
    assert json.loads((policy / "megarl_layout.json").read_text())["precision"] == "bf16"
    saved = dist_checkpointing.load_tensors_metadata(str(policy))
    model = {str(v.dtype) for k, v in saved.items() if not k.startswith("optimizer.")}
    main = {str(v.dtype) for k, v in saved.items() if k.startswith("optimizer.state.fp32_param.")}
    adam = {str(v.dtype) for k, v in saved.items() if k.startswith("optimizer.state.exp_avg")}
    assert model == {"torch.bfloat16"} and main == adam == {"torch.float32"}
    assert len([k for k in saved if k.startswith("optimizer.state.fp32_param.")]) == len(
        [k for k in saved if not k.startswith("optimizer.")])  # one fp32 main copy of every weight


@pytest.mark.slow  # (two more runs; the default run keeps test_resume's fp32 kill -9 and this file's bf16 checkpoint)
def test_kill_9_in_the_optimizer_step_then_resume_is_exact_in_bf16(model, baseline, tmp_path):
    ref_run, ref = baseline
    run = tmp_path / "run"
    train(_args(model, run), run, env={"MEGARL_TEST_KILL": "optimizer_step@3:1"}, rc=-signal.SIGKILL)
    assert read_metrics(run / "metrics.jsonl")[-1]["step"] == 2
    out = train(_args(model, run), run)
    assert "resumed from" in out
    assert [deterministic_view(r) for r in read_metrics(run / "metrics.jsonl")] == [deterministic_view(r) for r in ref]


def test_resuming_a_bf16_checkpoint_in_fp32_is_refused_before_launch(model, baseline):
    run, _ = baseline
    args = [*_args(model, run), "trainer.precision=fp32"]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "trainer.precision=fp32: the checkpoint" in proc.stderr
    assert "was saved with trainer.precision=bf16" in proc.stderr
    assert read_metrics(run / "metrics.jsonl")[-1].get("final")  # nothing launched: the run as the baseline left it


@pytest.mark.slow  # (the default run keeps the in-process engine's exact sync above)
def test_sync_into_a_bf16_replica_in_its_own_process_lands_the_trainers_weights_exactly(tmp_path):
    out = run_script(["tests/workers/bf16_replica_checks.py", str(tmp_path)], env={"OMP_NUM_THREADS": "1"})
    assert out["replica_dtype"] == "torch.bfloat16" and out["version"] == 1
    assert out["sync_bytes"] == 2 * out["params"]  # bf16 buckets: half of what an fp32 replica is sent
    # what the replica computes is, bit for bit, what a fresh bf16 engine on the trainer's exported weights computes
    assert out["equal_to_exported"] and not out["equal_to_original"]
