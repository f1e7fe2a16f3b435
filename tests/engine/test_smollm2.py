"""The real pretrained SmolLM2-135M-Instruct (from the wheel's GGUF, converted once per session): megarl's trainer
computes transformers' logprobs, the bf16 vLLM engine agrees with the bf16 trainer within bf16's rounding, and its
9 attention heads are refused at TP 2 before launch."""

from __future__ import annotations

import math

import pytest

from helpers.scripts import run_script
from megarl.config import ConfigError, load_config, validate
from megarl.models.hf_config import read_hf_config


def test_trainer_logprobs_equal_transformers_in_fp32_and_track_them_and_the_engine_in_bf16(smollm2):
    out = run_script(["tests/workers/smollm2_checks.py", str(smollm2)])
    assert out["tokens"] >= 40 and any("Paris" in r for r in out["responses"])  # a real model answering
    assert out["fp32"]["vs_transformers"]["max"] <= 1e-4
    # bf16 (measured: mean 0.027, max 0.12 against transformers in bf16; the engine against the trainer mean
    # 0.024, max 0.13 — bf16's 8-bit mantissa through 30 layers and different kernels)
    assert out["bf16"]["vs_transformers"]["mean"] < 0.05 and out["bf16"]["vs_transformers"]["max"] < 0.3
    assert out["bf16"]["engine_vs_trainer"]["mean"] < 0.05 and out["bf16"]["engine_vs_trainer"]["max"] < 0.3
    assert out["fp32"]["engine_vs_trainer"]["mean"] > 0  # (a bf16 engine against an fp32 trainer is not exact)


def test_its_nine_heads_are_refused_at_tensor_parallel_2_naming_the_key(smollm2):
    hf = read_hf_config(smollm2)
    assert (hf["num_attention_heads"], hf["num_key_value_heads"]) == (9, 3)
    with pytest.raises(ConfigError,
                       match=r"parallel.tp=2 must divide attention heads \(9\) and KV heads \(3\); valid: \[1, 3\]"):
        validate(load_config(None, [f"model.path={smollm2}", "parallel.tp=2"]), 2, hf)
    validate(load_config(None, [f"model.path={smollm2}", "parallel.pp=2"]), 2, hf)  # 30 layers: PP 2 is fine


def test_the_smollm2_example_writes_disjoint_data_and_passes_every_pre_launch_check(smollm2, tmp_path):
    """``examples/smollm2`` (``make demo-real``): its dataset script and its config against the real model, as
    ``megarl train`` checks them before any process starts (its measured gain: examples/smollm2/README.md)."""
    import json
    import subprocess
    import sys

    from helpers.scripts import ROOT
    from megarl.config.validate.prelaunch import checked_config

    out = tmp_path / "data"
    subprocess.run([sys.executable, "examples/smollm2/make_dataset.py", "--out", str(out)], cwd=ROOT, check=True,
                   timeout=120)
    rows = {name: [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
            for name in ("train", "test")}
    assert len(rows["test"]) == 200 and len(rows["train"]) >= 1000
    text = {name: {r["prompt"][-1]["content"] for r in rs} for name, rs in rows.items()}
    assert not text["train"] & text["test"]  # no held-out problem is trained on
    cfg = checked_config(str(ROOT / "examples/smollm2/config.yaml"),
                         [f"model.path={smollm2}", f"data.path={out}/train.jsonl", f"data.eval_path={out}/test.jsonl",
                          f"train.run_dir={tmp_path}/run"], nproc=1, command="train", notes=False)
    assert cfg.trainer.precision == "bf16" and cfg.engine.dtype == "auto" and not cfg.model.make_tiny


@pytest.mark.slow  # (a phase and two RL steps of the 135M model on CPU: minutes)
def test_feedback_episodes_keep_the_sampled_tokens_and_render_feedback_with_its_own_template(smollm2, tmp_path):
    """``examples/smollm2/multiturn.yaml``: SmolLM2 answers, the ``Feedback`` environment says a wrong number is
    wrong, SmolLM2 tries again. Every trajectory is its template's rendering of the whole conversation, each feedback
    message the template's own tokens, each model turn the tokens it sampled (ending with the EOS it sampled, a
    behaviour logprob each); then two RL steps train on the episodes, and the held-out evaluation plays episodes."""
    import subprocess
    import sys

    from helpers.scripts import ROOT

    data = tmp_path / "data"
    subprocess.run([sys.executable, "examples/smollm2/make_dataset.py", "--out", str(data), "--train", "200",
                    "--test", "20"], cwd=ROOT, check=True, timeout=120)
    out = run_script(["tests/workers/smollm2_episodes.py", str(smollm2), str(data), str(tmp_path / "run")],
                     timeout=1500)
    samples = out["samples"]
    assert len(samples) == 8 and all(x["len_ok"] and x["model_ok"] and x["text_is_template"] for x in samples)
    assert any(x["turns"] >= 2 for x in samples)  # (untrained, it is wrong ~0.7 of the time at T=0.6)
    assert all(x["env_rendered"] == [True] * (x["turns"] - 1) for x in samples)
    assert all(x["turns"] <= 3 for x in samples)
    for m in out["steps"]:
        assert math.isfinite(m["loss/policy"]) and m["rollout/turns_mean"] >= 1.0
        assert 0.0 <= m["rollout/env_token_fraction"] < 1.0
    assert max(m["rollout/turns_max"] for m in out["steps"]) >= 2
    e = out["eval"]  # greedy episodes: right at the first turn is right by the last (the environment stops there)
    assert e["prompts"] == 8 and 1.0 <= e["turns_mean"] <= 3.0 and e["env_errors"] == 0
    assert e["pass_at_1"] >= e["pass_at_1_first_turn"]
