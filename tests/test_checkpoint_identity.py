"""A checkpoint of another model is refused before anything loads, naming both models
(``megarl/checkpoint/identity.py``): ``mcore-to-hf --hf-config``, ``megarl eval --checkpoint``,
``megarl train`` resuming; and a fresh run in a used run dir sets the earlier run aside.

The user's case: a Qwen2 checkpoint (qkv biases, untied head) against a tied Llama of the same
sizes, both written by transformers (``from_config`` + ``save_pretrained``); the Qwen2 one converted
to a dist checkpoint by the tool, and laid out as a run's checkpoint (its ``policy/``, the run's
``config.json`` recording ``model.path``).
"""

import json
import shutil
import subprocess
import sys

import pytest
from hf_models import make_hf_model
from test_convert_checkpoint import convert, fails, safetensors_bytes

from conftest import ROOT, run_script


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    work = tmp_path_factory.mktemp("identity")
    qwen2 = make_hf_model(work / "qwen2", "qwen2_yarn", seed=1, rope_parameters={"rope_type": "default",
                                                                                    "rope_theta": 10000.0})
    llama = make_hf_model(work / "llama", "llama_tied_llama3", seed=1)
    convert("hf-to-mcore", "--hf", qwen2, "--out", work / "conv")
    run = work / "run"  # a run started from qwen2, as a run lays out its checkpoint
    step = run / "checkpoints" / "step_000001"
    shutil.copytree(work / "conv", step / "policy", ignore=shutil.ignore_patterns("hf", "megarl_conversion.json"))
    (step / "manifest.json").write_text('{"files": {}}')
    (run / "checkpoints" / "latest").write_text("step_000001\n")
    (run / "config.json").write_text(json.dumps({"model": {"path": str(qwen2)}}))
    return {"qwen2": qwen2, "llama": llama, "conv": work / "conv", "run": run, "step": step}


def test_mcore_to_hf_refuses_another_models_config_naming_both(models, tmp_path, capsys):
    m = models
    fails(tmp_path, capsys, ["mcore-to-hf", "--ckpt", m["step"], "--hf-config", m["llama"], "--out", tmp_path / "out"],
          f"holds another model than --hf-config {m['llama']}", "qkv biases: checkpoint yes, model no",
          "tied embeddings: checkpoint no, model yes", f"started from model.path={m['qwen2']}",
          str(m["run"] / "config.json"))
    fails(tmp_path, capsys, ["mcore-to-hf", "--ckpt", m["conv"], "--hf-config", m["llama"], "--out", tmp_path / "out"],
          f"converted from {m['qwen2']}", "megarl_conversion.json")


def test_eval_and_resume_refuse_another_models_checkpoint_before_launch(models, tmp_path):
    m = models

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "megarl.cli", *args, "--config", "configs/demo.yaml",
                               f"model.path={m['llama']}", "engine.max_model_len=128"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)

    ev = cli("eval", "--checkpoint", str(m["conv"]), f"eval.output={tmp_path / 'eval.json'}")
    assert ev.returncode == 2, ev.stderr[-3000:]
    assert f"holds another model than model.path={m['llama']}" in ev.stderr and str(m["qwen2"]) in ev.stderr
    tr = cli("train", f"train.run_dir={m['run']}")
    assert tr.returncode == 2, tr.stderr[-3000:]
    assert f"train.resume=auto in train.run_dir={m['run']}" in tr.stderr
    assert f"started from model.path={m['qwen2']}" in tr.stderr and "tied embeddings" in tr.stderr
    assert not (tmp_path / "eval_session").exists() and not (m["run"] / "tb").exists()  # nothing launched


def test_the_same_model_passes_and_a_policy_subdir_is_not_a_step_dir(models):
    from megarl.checkpoint.identity import ModelMismatch, check_same_model
    from megarl.config import ConfigError, load_config, validate
    from megarl.config.loader import validate_resume_model
    from megarl.models.hf_config import read_hf_config

    m = models
    qwen2, llama = read_hf_config(m["qwen2"]), read_hf_config(m["llama"])
    check_same_model(m["step"] / "policy", qwen2, "qwen2")  # a copy elsewhere would pass too: paths are not compared
    check_same_model(m["conv"], qwen2, "qwen2")
    with pytest.raises(ModelMismatch, match="qkv biases: checkpoint yes, model no"):
        check_same_model(m["conv"], llama, "llama")
    halved = {**qwen2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16}  # the same tensor shapes
    with pytest.raises(ModelMismatch, match="attention heads: checkpoint 4, model 8"):  # told by the recorded config
        check_same_model(m["conv"], halved, "halved")
    validate_resume_model(load_config(None, [f"model.path={m['qwen2']}", f"train.run_dir={m['run']}"]), qwen2)
    with pytest.raises(ConfigError, match="tied embeddings: checkpoint no, model yes"):
        validate_resume_model(load_config(None, [f"train.resume={m['step']}"]), llama)
    for path, message in ((m["step"] / "policy", f"expected a run checkpoint step dir ({m['step']}), got its policy/ subdir"),
                          (m["run"], f"got a run dir; pass {m['step']}"),
                          (m["conv"], "a megatron dist checkpoint of the weights alone")):
        with pytest.raises(ConfigError, match=__import__("re").escape(message)):
            validate(load_config(None, [f"train.resume={path}"]), 1)


@pytest.mark.slow
def test_mcore_to_hf_takes_a_run_step_dir_and_its_recorded_model(models, tmp_path):
    m = models
    out = convert("mcore-to-hf", "--ckpt", m["step"], "--out", tmp_path / "back")  # no --hf-config
    assert f"--hf-config: {m['qwen2']}" in out.stdout and "HF tensors" in out.stdout
    original, back = safetensors_bytes(m["qwen2"]), safetensors_bytes(tmp_path / "back")
    assert back.keys() == original.keys() and all(back[k] == original[k] for k in original)


def test_a_fresh_run_sets_the_earlier_one_aside(tmp_path):
    """train.resume=never in a run dir with checkpoints step 6, 7 and exports hf/step_6, 7: the new
    run's rotation (keep 2) keeps its own steps 2, 3 and nothing of the old run is deleted or mixed."""
    out = run_script(["tests/fresh_run_checks.py", str(tmp_path / "run")], env={"OMP_NUM_THREADS": "1"})
    assert out["resumed"] == "None" and len(out["aside"]) == 1
    assert out["steps"] == [3, 2] and out["hf"] == ["step_3"]
    assert out["prev_steps"] == [7, 6] and out["prev_hf"] == ["step_6", "step_7"] and out["prev_weights"] == "old"
    assert out["prev_metrics"] == '{"step": 7}\n' and '"old"' in out["prev_config"] and out["prev_tb"] == ["events.old"]
    assert out["left"] == sorted(["checkpoints", "config.json", "hf", *out["aside"]])
    assert out["auto_nothing"] == "None"


@pytest.mark.slow
def test_mcore_to_hf_refuses_tensors_the_config_has_no_place_for(tmp_path):
    """Same architecture as far as the identity check sees, but the config drops Qwen2-MoE's shared
    expert: its tensors would be left out of the HF output, so the conversion refuses, naming them."""
    model = make_hf_model(tmp_path / "model", "qwen2_moe", seed=1)
    convert("hf-to-mcore", "--hf", model, "--out", tmp_path / "ckpt")
    shutil.copytree(model, tmp_path / "noshared")
    cfg = json.loads((model / "config.json").read_text())
    (tmp_path / "noshared" / "config.json").write_text(json.dumps({**cfg, "shared_expert_intermediate_size": 0}))
    proc = convert("mcore-to-hf", "--ckpt", tmp_path / "ckpt", "--hf-config", tmp_path / "noshared", "--out",
                   tmp_path / "out", check=False)  # in its own process: the check comes after megatron's skeleton
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "would be dropped" in proc.stderr and "decoder.layers.mlp.shared_experts.linear_fc1.weight" in proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
