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

from helpers.conversion import convert, fails, safetensors_bytes
from helpers.hf_models import make_hf_model
from helpers.scripts import ROOT, run_script


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
    from megarl.config.validate.model import validate_resume_model
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
    # the same tensors under other math: RoPE (a user's copy of the config with the default theta), the norm's eps
    with pytest.raises(ModelMismatch, match=r"RoPE: checkpoint rope_theta=10000\.0, rope_type=default, model "
                                            r"rope_theta=500000\.0, rope_type=default"):
        check_same_model(m["step"] / "policy", {**qwen2, "rope_parameters": {"rope_type": "default",
                                                                             "rope_theta": 500000}}, "theta 5e5")
    with pytest.raises(ModelMismatch, match=r"RoPE: .*model factor=8\.0, .*rope_type=llama3.*export with the "
                                            r"checkpoint's own config"):
        check_same_model(m["conv"], {**qwen2, "rope_parameters": {**llama["rope_parameters"]}}, "llama3 rope")
    with pytest.raises(ModelMismatch, match="RMS norm eps: checkpoint 1e-06, model 1e-05"):
        check_same_model(m["conv"], {**qwen2, "rms_norm_eps": 1e-5}, "eps")
    check_same_model(m["conv"], {**qwen2, "rope_parameters": None, "rope_scaling": None, "rope_theta": 10000},
                     "the older rope_theta key, an int")  # the same RoPE written the transformers-4 way
    validate_resume_model(load_config(None, [f"model.path={m['qwen2']}", f"train.run_dir={m['run']}"]), qwen2)
    with pytest.raises(ConfigError, match="tied embeddings: checkpoint no, model yes"):
        validate_resume_model(load_config(None, [f"train.resume={m['step']}"]), llama)
    for path, message in ((m["step"] / "policy",
                           f"expected a run checkpoint step dir ({m['step']}), got its policy/ subdir"),
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
    out = run_script(["tests/workers/fresh_run_checks.py", str(tmp_path / "run")], env={"OMP_NUM_THREADS": "1"})
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


def _critic_beside(step):
    """A critic's checkpoint as a PPO run saves it beside ``policy/``: the same backbone, the value head
    (``output_layer.weight [1, hidden]`` and a bias) in place of the LM head (written by torch's own writer)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from megarl.checkpoint.identity import model_tensor_shapes

    shapes = model_tensor_shapes(step / "policy")
    state = {k: torch.zeros(v) for k, v in shapes.items() if k != "output_layer.weight"}
    hidden = shapes["embedding.word_embeddings.weight"][1]
    state.update({"output_layer.weight": torch.zeros(1, hidden), "output_layer.bias": torch.zeros(1)})
    dcp.save(state, checkpoint_id=str(step / "critic"))
    shutil.copy(step / "policy" / "metadata.json", step / "critic" / "metadata.json")
    return step / "critic"


def _cli(capsys, *args):
    """``megarl`` in this process (the refusals come before any process starts): (exit status, stderr)."""
    from megarl.cli import main

    status = main([*map(str, args)])
    return status, capsys.readouterr().err


def test_eval_of_a_critic_checkpoint_is_refused_naming_the_policy(models, tmp_path, capsys):
    """``megarl eval --checkpoint step_N/critic`` evaluated the value network as the policy."""
    from megarl.checkpoint.identity import ModelMismatch, check_same_model
    from megarl.models.hf_config import read_hf_config

    m = models
    step = tmp_path / "run" / "checkpoints" / "step_000001"
    shutil.copytree(m["step"], step)
    critic = _critic_beside(step)
    with pytest.raises(ModelMismatch, match="is a critic's checkpoint"):
        check_same_model(critic, read_hf_config(m["qwen2"]), "qwen2")
    status, err = _cli(capsys, "eval", "--checkpoint", critic, "--config", ROOT / "configs/demo.yaml",
                       f"model.path={m['qwen2']}", "engine.max_model_len=128", f"eval.output={tmp_path / 'e.json'}")
    assert status == 2, err
    assert f"{critic} is a critic's checkpoint" in err and "value head" in err
    assert f"pass the policy of the same step, {step / 'policy'}" in err
    assert not (tmp_path / "eval_session").exists()


def test_eval_of_a_reference_checkpoint_says_what_it_is(models, tmp_path):
    """a run's ``reference/`` is legitimate to evaluate, but it is the frozen initial model."""
    from megarl.evaluation import checkpoint_note, resolve_checkpoint

    step = tmp_path / "checkpoints" / "step_000001"
    shutil.copytree(models["step"], step)
    shutil.copytree(step / "policy", step / "reference")
    kind, path = resolve_checkpoint(step / "reference")
    assert (kind, path) == ("dist", step / "reference")
    note = checkpoint_note(kind, path)
    assert "the frozen initial model" in note and "never trained" in note and str(step / "policy") in note
    assert checkpoint_note(*resolve_checkpoint(step)) == ""  # the policy needs no note


def _grpo_run(models, run):
    """A GRPO run's directory: checkpoints holding policy/ alone, its config.json recording the algorithm."""
    shutil.copytree(models["run"], run)
    (run / "config.json").write_text(json.dumps({"model": {"path": str(models["qwen2"])},
                                                 "algo": {"advantage": "grpo", "kl_coef": 0.0}}))
    return run


def test_resume_without_the_critic_or_reference_the_algorithm_needs_is_refused_before_launch(models, tmp_path, capsys):
    """resuming a GRPO run with algo.preset=ppo crashed in keeper.resume after the whole launch."""
    from megarl.config import ConfigError, load_config
    from megarl.config.validate.model import check_resume_learners

    run = _grpo_run(models, tmp_path / "run")
    step = run / "checkpoints" / "step_000001"
    with pytest.raises(ConfigError) as exc:
        check_resume_learners(load_config(None, ["algo.preset=ppo", f"train.run_dir={run}"]))
    text = str(exc.value)
    assert f"train.resume=auto in train.run_dir={run}: the checkpoint {step} has no critic/" in text
    assert "(algo.advantage=gae trains a critic) and no reference/" in text and "of algo.preset=ppo" in text
    assert "algo.advantage=grpo, algo.kl_coef=0.0" in text and "train.resume=never" in text
    assert "another train.run_dir" in text
    with pytest.raises(ConfigError, match=r"has no reference/ \(algo.kl_coef=0.01 needs the frozen reference"):
        check_resume_learners(load_config(None, ["algo.kl_coef=0.01", f"train.resume={step}"]))
    check_resume_learners(load_config(None, [f"train.run_dir={run}"]))  # the run's own algorithm resumes
    check_resume_learners(load_config(None, ["algo.preset=ppo", f"train.run_dir={run}", "train.resume=never"]))
    shutil.copytree(step / "policy", step / "reference")
    _critic_beside(step)
    check_resume_learners(load_config(None, ["algo.preset=ppo", f"train.run_dir={run}"]))
    # the other way: a PPO run resumed with a group advantage dropped its trained critic without a word, and the
    # next saves rotated away the last checkpoints that held it
    with pytest.raises(ConfigError, match=rf"the checkpoint {step} holds a trained critic/, which "
                                          r"algo.advantage=grpo of algo.preset=grpo does not use.*Resume with the "
                                          r"original algorithm.*another train.run_dir"):
        check_resume_learners(load_config(None, ["algo.preset=grpo", f"train.run_dir={run}"]))
    check_resume_learners(load_config(None, ["algo.preset=grpo", f"train.run_dir={tmp_path / 'new'}",
                                             f"train.resume={step}"]))  # elsewhere: this run's checkpoints stay
    # through the command line: exit 2 before anything starts
    shutil.rmtree(step / "critic")
    status, err = _cli(capsys, "train", "--config", ROOT / "configs/demo.yaml", "algo.advantage=gae",
                       f"model.path={models['qwen2']}", "engine.max_model_len=128", f"train.run_dir={run}")
    assert status == 2 and "has no critic/" in err, err
    assert not (run / "tb").exists()


def test_check_conversion_runs_the_identity_check(models, tmp_path, capsys):
    """an untied checkpoint against a tied model of the same sizes PASSed (its output layer never
    loaded); the check is mcore-to-hf's, before anything is built."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_conversion", ROOT / "tools/check_conversion.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    tied = make_hf_model(tmp_path / "qwen2_tied", "qwen2_yarn", seed=1, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert check.main(["--hf", str(tied), "--ckpt", str(models["conv"])]) == 1
    out = capsys.readouterr().out
    assert f"check_conversion: FAIL {models['conv']} holds another model than --hf {tied}" in out
    assert "tied embeddings: checkpoint no, model yes" in out
    # a run's step dir and its run dir: their policy/ (was "FileNotFoundError: .../.metadata", exit 1)
    for given in (models["step"], models["run"]):
        assert check.main(["--hf", str(tied), "--ckpt", str(given)]) == 1
        out = capsys.readouterr().out
        assert f"{models['step'] / 'policy'} (the policy of the run checkpoint {models['step']})" in out
        assert f"check_conversion: FAIL {models['step'] / 'policy'} holds another model" in out
    assert check.main(["--hf", str(tied), "--ckpt", str(tmp_path)]) == 2  # no checkpoint there: a usage error
    assert f"check_conversion: error: {tmp_path} is not a megatron dist checkpoint" in capsys.readouterr().err


def test_check_conversion_keeps_the_part_of_a_load_error_that_names_the_tensor():
    """torch's CheckpointException was cut at 300 characters, inside its traceback."""
    import importlib.util
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    spec = importlib.util.spec_from_file_location("check_conversion", ROOT / "tools/check_conversion.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    stack = traceback.extract_stack() * 5  # a long traceback, as torch's reader gives
    exc = CheckpointException("load", {0: (KeyError("decoder.layers.self_attention.linear_qkv.bias"), stack)})
    assert check.load_error(exc) == "CheckpointException: KeyError: 'decoder.layers.self_attention.linear_qkv.bias'"
    assert check.load_error(ValueError("shape mismatch")) == "ValueError: shape mismatch"


def test_a_relative_model_path_is_found_from_the_runs_launch_directory(models, tmp_path, monkeypatch):
    """a run launched from /x with train.run_dir=runs/a, model.path=runs/a/model; mcore-to-hf
    from another directory said the model 'exists here' when it did not."""
    from megarl.checkpoint.identity import recorded_source

    launch = tmp_path / "launch"
    run = launch / "runs" / "a"
    shutil.copytree(models["run"], run)
    (run / "config.json").write_text(json.dumps({"model": {"path": "runs/a/model"}, "train": {"run_dir": "runs/a"}}))
    policy = run / "checkpoints" / "step_000001" / "policy"
    monkeypatch.chdir(tmp_path)  # not the launch directory
    words, found = recorded_source(policy)
    assert found is None and ", found at" not in words  # (the words of a model found: not said of a missing one)
    assert f"which does not exist here: no config.json in {tmp_path / 'runs/a/model'} (relative to the current " \
           f"directory) nor in {run / 'model'} (relative to the directory the run was launched from)" in words
    shutil.copytree(models["qwen2"], run / "model")
    words, found = recorded_source(policy)
    assert found == run / "model" and f"found at {run / 'model'}" in words
    monkeypatch.chdir(launch)  # from the launch directory: the recorded path as it is
    assert recorded_source(policy)[1] == __import__("pathlib").Path("runs/a/model")


def test_mcore_to_hf_says_when_a_runs_recorded_model_is_not_there(models, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(models["run"], run)
    (run / "config.json").write_text(json.dumps({"model": {"path": "gone/model"}, "train": {"run_dir": "run"}}))
    monkeypatch.chdir(tmp_path / "run" / "checkpoints")
    fails(tmp_path, capsys, ["mcore-to-hf", "--ckpt", run, "--out", tmp_path / "out"],
          "started from model.path=gone/model", "which does not exist here", "pass --hf-config DIR")


def test_inspect_takes_a_run_dir(models, capsys):
    """a run dir (which has megarl's config.json) was taken for an HF directory."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("inspect_checkpoint", ROOT / "tools/inspect_checkpoint.py")
    inspect = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(inspect)
    assert inspect.main([str(models["run"]), "--summary"]) == 0
    out = capsys.readouterr().out
    assert f"mcore checkpoint {models['step'] / 'policy'}:" in out and "parameters" in out


def test_dense_layers_beside_experts_are_compared_by_count_and_by_place(tmp_path):
    """Qwen2-MoE with layer 1 dense (``mlp_only_layers``): a config with no dense layer stacks the router over
    every layer (count told by the tensors); one whose dense layer is layer 0 has the very same tensor shapes
    and is told apart by the converted checkpoint's recorded config."""
    from megarl.checkpoint.identity import ModelMismatch, check_same_model
    from megarl.models.hf_config import read_hf_config

    hf = make_hf_model(tmp_path / "moe", "qwen2_moe_dense1", seed=1)
    convert("hf-to-mcore", "--hf", hf, "--out", tmp_path / "conv")
    cfg = read_hf_config(hf)
    layers = cfg["num_hidden_layers"]
    assert layers > 2 and cfg["mlp_only_layers"] == [1]
    check_same_model(tmp_path / "conv", cfg, "itself")
    with pytest.raises(ModelMismatch, match=f"layers with experts: checkpoint {layers - 1}, model {layers}"):
        check_same_model(tmp_path / "conv", {**cfg, "mlp_only_layers": []}, "all sparse")
    with pytest.raises(ModelMismatch, match=r"dense layers: checkpoint \[1\], model \[0\]"):
        check_same_model(tmp_path / "conv", {**cfg, "mlp_only_layers": [0]}, "layer 0 dense")
