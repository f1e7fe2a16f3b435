"""The GPU check (``tools/gpu_check.sh``, ``tools/gpu_check.py``) without a GPU: its install step, its setup, and
its stop at the first part that needs CUDA; and the plan estimate its 1B step is compared with. The parts themselves
(the trainer on CUDA, the kernels bit for bit) run where CUDA is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.scripts import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402  (tools/ on the path first)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: the check runs whole")
def test_without_cuda_the_check_installs_runs_its_setup_and_stops_saying_why(tmp_path):
    wheels = tmp_path / "wheels"  # nothing to install: every package it needs is here already
    wheels.mkdir()
    env = {**os.environ, "PYTHON": sys.executable, "WHEELS": str(wheels)}
    proc = subprocess.run(["bash", "tools/gpu_check.sh", str(tmp_path / "out")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == gpu_check.NO_CUDA, proc.stdout + proc.stderr
    assert "installing what is missing of megatron-core==0.16.1 pyyaml safetensors pytest" in proc.stdout
    assert "install from" not in proc.stderr  # (pip found each one installed)
    assert "no CUDA device here (torch.cuda.is_available() is False): stopped after the setup" in proc.stderr
    figures = json.loads((tmp_path / "out" / "figures.json").read_text())
    assert list(figures) == ["setup"]  # no part ran
    s = figures["setup"]
    assert s["cuda"] is False and s["torch"] == torch.__version__ and "gpu" not in s
    assert s["modules"]["megatron.core"] and s["modules"]["yaml"] and s["versions"]["megatron-core"] == "0.16.1"
    assert s["modules"]["transformer_engine"] is False and "transformer_engine" in s["left_out"]
    assert f"left out: {gpu_check.LEFT_OUT['transformer_engine']}: transformer_engine is not installed" in proc.stdout


def test_the_1b_step_is_compared_with_the_plans_own_figures_for_its_shapes():
    """One policy forward, backward and optimizer step (no other pass), on one GPU: the plan's training FLOPs are
    3 forwards of the step's tokens, its trainer memory bf16 weights, fp32 gradients and Adam state, activations and
    the logprob chunk's logits."""
    from megarl.launch.model_size import count_params

    params = count_params(gpu_check.LLAMA_1B).total
    assert 1.2e9 < params < 1.3e9  # Llama-3.2-1B: 1.24B
    b = gpu_check.BIG_BATCH
    est = gpu_check.plan_estimate(gpu_check.LLAMA_1B, "NVIDIA H200", 139.8)
    tokens = b["sequences"] * (b["prompt"] + b["response"])
    assert est["preset"] == "h200" and est["tokens"] == tokens == 16384
    assert 6 * params * tokens < est["flops"] < 6.6 * params * tokens  # (+ the tied head's GEMM and attention)
    parts = est["parts_gib"]
    assert parts["weights"] == pytest.approx(params * 2 / 2**30) and parts["optimizer"] == 6 * parts["weights"]
    assert est["trainer_gib"] == pytest.approx(sum(parts.values())) and parts["activations"] > 0
    assert 0 < est["train_s"] < 1
    assert gpu_check.plan_estimate(gpu_check.LLAMA_1B, "NVIDIA H100 80GB HBM3", 79.6)["preset"] == "h100"


def tiny_leg(call: str, tmp_path) -> dict:
    """A leg of the GPU check's ``tiny`` part (``call``: 'gpu_check.<call>Path(tmp_path)))'), in a fresh interpreter
    (megarl's CPU adapter patches torch.cuda): its JSON result."""
    code = ("import json, sys; from pathlib import Path; sys.path.insert(0, 'tools'); import gpu_check; "
            f"print(json.dumps(gpu_check.{call}Path({str(tmp_path)!r}))))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_tiny_parts_lora_leg_trains_the_adapters_alone(tmp_path):
    """The LoRA leg of the ``tiny`` part, here on CPU (on the GPU its dropout draws from megatron's CUDA tracker): the
    loss falls, every base weight stays bit for bit, the adapters' B leave zero."""
    r = tiny_leg("tiny_lora(3, ", tmp_path)
    assert r["ok"] and r["base_unchanged"] and r["b_max"] > 0 and r["losses"][-1] < r["losses"][0]
    assert r["adapters"] == 4 * (2 + 4 * 2)  # 4 layers: linear_qkv, linear_proj, 4 experts' linear_fc1 and fc2
    assert gpu_check.summary_line("tiny", {"ok": True, **{f: {"losses": [2.0, 1.0]} for f in (
        "qwen3_moe", "qwen2")}, "qwen3_moe_lora": r}).endswith(f"qwen3_moe_lora loss {r['losses'][0]:.3f} -> "
                                                              f"{r['losses'][-1]:.3f}")


@pytest.mark.slow  # (the behaviour's default test: tests/distributed/test_host_reference.py)
def test_the_tiny_parts_host_reference_leg_scores_as_a_reference_on_the_device(tmp_path):
    """The ``tiny`` part's ``trainer.reference_on_host`` leg, here on CPU (on the GPU its weights are pinned host
    memory and must add no GPU memory): the same logprobs as a frozen reference of its own, the policy given back."""
    r = tiny_leg("tiny_host_reference(", tmp_path)
    assert r["ok"] and r["reference_gap"] == 0 and r["policy_gap"] > 0 and r["weights_back"] and r["logprobs_back"]
