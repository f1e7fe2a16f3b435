"""The math example end to end: dataset script → ``megarl train`` (math-verify reward, chat prompts) →
TensorBoard metrics → ``megarl eval`` on the run's dist checkpoint (and, slow, on an HF dir)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.runs import megarl, scalars
from helpers.scripts import ROOT, run_script

CONFIG = ROOT / "examples" / "math" / "config.yaml"


def tiny(tmp_path) -> list[str]:
    """Overrides that keep the example small: a few prompts, short responses, a small KV cache."""
    return [f"data.path={tmp_path}/data/train.jsonl", f"data.eval_path={tmp_path}/data/test.jsonl",
            "data.eval_size=6", f"model.path={tmp_path}/model", "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12", "engine.slots=16",
            "engine.kv_cache_gib=0.125", "reward.workers=1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("math")
    subprocess.run([sys.executable, "examples/math/make_dataset.py", "--out", str(tmp / "data"), "--train", "64",
                    "--test", "8"], cwd=ROOT, check=True, capture_output=True)
    megarl("train", "--config", str(CONFIG), *tiny(tmp), "train.steps=2", f"train.run_dir={tmp}/run")
    return tmp


def test_math_example_trains_with_reward_and_data_metrics_in_tensorboard(trained):
    s = scalars(trained / "run")
    for tag in ("reward/mean", "reward/pass_rate", "reward/errors", "reward/timeouts", "reward/format",
                "reward/correct", "data/epoch", "data/bad_rows", "data/prompts_too_long", "eval/pass_at_1"):
        assert tag in s, (tag, sorted(s))
    assert len(s["reward/mean"]) == 2 and s["reward/errors"][-1] == 0.0
    assert all(0.0 <= v <= 1.0 for v in s["reward/format"])  # a mean of 0/1 flags (the dict reward's extra)
    assert 0 < s["data/epoch"][-1] < 1  # 4 of the ~66 rows drawn


@pytest.mark.slow  # (31 s; a dist checkpoint into a trainer stays in the default run: test_start_from_dist.py)
def test_megarl_eval_on_a_run_dir_loads_its_dist_checkpoint(trained):
    run = trained / "run"
    got = run_script(["tests/workers/eval_checks.py", str(CONFIG), str(run), *tiny(trained)])
    assert got["base"] != got["moved"]  # the checkpoint's weights generate differently from the HF model's
    out = trained / "eval.json"
    proc = megarl("eval", "--config", str(CONFIG), *tiny(trained), "--checkpoint", str(run), f"eval.output={out}")
    result = json.loads(out.read_text())
    assert result["kind"] == "dist" and result["checkpoint"].endswith("checkpoints/step_2/policy")
    assert [e["response"] for e in result["examples"]] == got["moved"]
    assert result["prompts"] == 6 and 0.0 <= result["pass_at_1"] <= 1.0
    assert "pass_at_1" in proc.stdout and "metric" in proc.stdout  # the printed table


@pytest.mark.slow
def test_megarl_eval_on_an_hf_dir_with_pass_at_k(trained):
    out = trained / "eval_hf.json"
    megarl("eval", "--config", str(CONFIG), *tiny(trained), "--checkpoint", str(trained / "model"),
           "eval.samples=4", f"eval.output={out}")
    result = json.loads(out.read_text())
    assert result["kind"] == "hf" and {"pass_at_1", "pass_at_1_sampled", "pass_at_2", "pass_at_4"} <= set(result)
    assert result["pass_at_4"] >= result["pass_at_2"] >= result["pass_at_1_sampled"] - 1e-9


def test_bad_config_of_the_example_stops_before_any_process(trained, tmp_path, capsys):
    from megarl.cli import main

    def fails(*args: str) -> str:  # (the command's own entry point: status 2 before it launches anything)
        assert main(list(args)) == 2, capsys.readouterr().err[-2000:]
        return capsys.readouterr().err

    base = ["--config", str(CONFIG), *tiny(trained)]
    assert "missing.jsonl': no such file" in fails("train", *base, f"data.path={tmp_path}/missing.jsonl")
    assert "not an HF model dir" in fails("eval", *base, "--checkpoint", str(tmp_path))
    assert "needs data.eval_path" in fails("eval", *base, "data.eval_path=")


def test_checkpoint_paths_resolve_like_the_run_layout(tmp_path):
    from megarl.evaluation import resolve_checkpoint

    step = tmp_path / "run" / "checkpoints" / "step_7"
    (step / "policy").mkdir(parents=True)
    (step / "policy" / "metadata.json").write_text("{}")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    older = tmp_path / "run" / "checkpoints" / "step_3"
    (older / "policy").mkdir(parents=True)
    (older / "policy" / "metadata.json").write_text("{}")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_3\n")
    assert resolve_checkpoint(tmp_path / "run") == ("dist", older / "policy")  # latest's, though not the newest
    assert resolve_checkpoint(step) == ("dist", step / "policy")
    assert resolve_checkpoint(step / "policy") == ("dist", step / "policy")
    assert resolve_checkpoint(hf) == ("hf", hf)
    # latest names a step that is gone (pruned by hand): the newest there is, as train.resume=auto would take
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_9\n")
    assert resolve_checkpoint(tmp_path / "run") == ("dist", step / "policy")
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="a run dir without a checkpoint"):
        resolve_checkpoint(tmp_path / "empty")
    # the result goes beside the run checkpoint evaluated (the config's run dir may be another run's)
    from megarl.config import load_config
    from megarl.evaluation import output_path

    cfg = load_config(None, [f"train.run_dir={tmp_path / 'other'}"])
    assert output_path(cfg, *resolve_checkpoint(tmp_path / "run")) == tmp_path / "run" / "eval_step_7.json"
    assert output_path(cfg, "dist", step / "reference") == tmp_path / "run" / "eval_step_7_reference.json"
    assert output_path(cfg, "hf", hf) == tmp_path / "other" / "eval.json"
    assert output_path(load_config(None, ["eval.output=x.json"]), "dist", step / "policy") == Path("x.json")
