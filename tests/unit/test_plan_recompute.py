"""``megarl plan`` with activation recompute (``trainer.recompute``): the activations and the step's extra compute
of each mode against hand calculations, and the proposal that needs recompute to fit."""

import json

import pytest

from helpers.plans import QWEN3_30B_A3B, RUN
from helpers.scripts import ROOT
from megarl.config import load_config
from megarl.launch.gpus import PRESETS
from megarl.launch.memory import GIB, core_attention_floats
from megarl.launch.model_size import count_params
from megarl.launch.plan import main, plan
from megarl.launch.step_time import work_of

LAYOUT = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=8", "parallel.etp=1",
          "engine.tensor_parallel_size=8"]


def _plan(overrides, nodes=2):
    cfg = load_config(None, ["trainer.precision=fp32", *RUN, *LAYOUT, *overrides])
    return plan(QWEN3_30B_A3B, cfg, nodes, 8, 80)


def test_activations_of_each_mode_match_the_hand_calculation():
    """Qwen3-30B-A3B, TP 2 + SP, PP 1, one micro-batch of 4096 tokens in fp32: none keeps every layer's activations
    (attention 2h + 2q + 2kv, MoE h + topk·(h + 3f_e) per token and layer); selective the same (the packed rows'
    attention is fused: nothing of its own to drop); full keeps each layer's input h and one layer's working set."""
    h, q, kv, f_e, topk, layers = 2048, 32 * 128, 4 * 128, 768, 8, 48
    per_layer = (2 * h + 2 * q + 2 * kv) + (h + topk * (h + 3 * f_e))
    tokens, w, tp = 4096, 4, 2
    none = per_layer * layers * tokens * w / tp / GIB
    full = (layers * h + per_layer) * tokens * w / tp / GIB
    res = _plan([])
    assert res["activations_by_recompute"] == pytest.approx({"none": none, "selective": none, "full": full})
    assert res["memory_gib_per_gpu"]["activations"] == pytest.approx(none)  # (the config's mode: none)
    units = _plan(["trainer.recompute=full", "trainer.recompute_layers=4"])  # 12 inputs kept, 4 layers' working set
    assert units["memory_gib_per_gpu"]["activations"] == pytest.approx(
        (layers // 4 * h + 4 * per_layer) * tokens * w / tp / GIB)
    assert "trainer.recompute=full" in units["overrides"] and "trainer.recompute_layers=4" in units["overrides"]


def test_selective_drops_the_unfused_attention_scores_of_padded_rows():
    """Padded rows on the local spec (trainer.packing=false, model.transformer_engine=false): megatron's unfused
    attention keeps the scores and their softmax, 2 · heads · s floats per token and layer; selective drops them."""
    cfg = load_config(None, [*RUN, "trainer.packing=false", "model.transformer_engine=false"])
    assert core_attention_floats(QWEN3_30B_A3B, cfg) == 2 * 32 * 4096
    auto = load_config(None, [*RUN, "trainer.packing=false"])  # auto: Transformer Engine's fused attention on GPUs
    assert core_attention_floats(QWEN3_30B_A3B, auto) == 0 and core_attention_floats(QWEN3_30B_A3B, auto, cpu=True)
    res = _plan(["trainer.packing=false", "model.transformer_engine=false"])
    by = res["activations_by_recompute"]
    scores = 2 * 32 * 4096 * 48 * 4096 * 4 / 2 / GIB  # per token and layer × layers × tokens × w / TP
    assert by["none"] - by["selective"] == pytest.approx(scores)


def test_recompute_adds_the_forward_it_runs_again_to_the_step():
    """full: T × (2·N_layers + 2·L·q·s) more FLOPs (N_layers: active parameters less embedding and head), and its
    forward's TP all-reduces (2 more of the 4 per layer); selective: the core attention's forward, T × 2·L·q·s."""
    counts, gpu = count_params(QWEN3_30B_A3B), PRESETS["h100"]
    steps = {mode: _plan([f"trainer.recompute={mode}"])["step_time"]["train"] for mode in ("none", "selective", "full")}
    cfg = load_config(None, [*RUN])
    work = work_of(cfg, QWEN3_30B_A3B)
    tokens, s, q, layers = work.tokens, work.prompt_tokens + work.response_tokens, 32 * 128, 48
    per_second = 16 * gpu.peak_tflops * 1e12 * work.mfu
    full = tokens * (2 * (counts.active - counts.embedding - counts.head) + 2 * layers * q * s)
    assert steps["none"]["recompute_s"] == 0
    experts, eff = tokens * 2 * counts.experts_active, steps["full"]["expert_efficiency"]  # (grouped GEMMs: ~1)
    assert 0.9 < eff <= 1
    assert steps["full"]["recompute_s"] == pytest.approx((full - experts + experts / eff) / per_second)
    assert steps["selective"]["recompute_s"] == pytest.approx(tokens * 2 * layers * q * s / per_second)
    assert steps["full"]["tp_s"] == pytest.approx(steps["none"]["tp_s"] * 6 / 4)
    assert 0.25 < steps["full"]["recompute_s"] / steps["none"]["compute_s"] < 0.34  # ~ a third more compute


DONE_WHEN = ["--model", str(ROOT / "examples/models/qwen3-30b-a3b.json"), "--nodes", "4", "--gpus-per-node", "8",
             "--gpu-mem-gib", "80", "--prompt-tokens", "512", "--response-tokens", "16384",
             "rollout.max_new_tokens=16384", "engine.max_model_len=16896", "engine.slots=64", "engine.kv_cache_gib=12",
             "trainer.max_tokens_per_microbatch=67584"]
"""Qwen3-30B-A3B on 4 × 8 GPUs of 80 GiB, 512-token prompts and 16k-token responses, token-balanced micro-batches
of four such rows (bf16, the defaults' 32 prompts × 8 samples)."""


def test_qwen3_30b_long_responses_fit_with_full_recompute_only(capsys):
    # no layout fits without recompute at CP 1 (unset, parallel.cp would be weighed: long responses, nothing fits)
    assert main([*DONE_WHEN, "trainer.recompute=none", "parallel.cp=1", "--json"]) == 1
    assert not json.loads(capsys.readouterr().out)["fits"]
    assert main(DONE_WHEN) == 0
    out = capsys.readouterr().out
    layout = next(line for line in out.splitlines() if line.startswith("layout"))
    assert "· recompute full |" in layout and "[proposed]" in layout, out
    assert "trainer.recompute=full" in next(line for line in out.splitlines() if line.startswith("settings"))
    step = next(line for line in out.splitlines() if line.startswith("step time"))
    assert "s/step (train" in step and "recompute full" in step, out
    assert "+ recompute " in next(line for line in out.splitlines() if line.startswith("  train")), out
