"""A new user's small stumbles, each an error or a usage text before anything starts: a key given
twice in YAML, ``examples/*.sh --help``, ``megarl train|eval --help``, ``megarl plan`` on a tiny
model, ``tools/make_tiny_model.py``'s families."""

import subprocess
import sys

import pytest

from helpers.scripts import ROOT
from megarl.config import ConfigError, load_config


def test_a_key_given_twice_names_the_file_line_and_key(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("model:\n  path: m\ntrain:\n  steps: 3\n  save_every: 1\n  steps: 7\n")
    with pytest.raises(ConfigError, match=rf"{path} line 6: duplicate key 'train.steps' \(first given on line 4\)"):
        load_config(path)
    (tmp_path / "twice.yaml").write_text("train:\n  steps: 3\ntrain:\n  seed: 1\n")
    with pytest.raises(ConfigError, match="line 3: duplicate key 'train'"):
        load_config(tmp_path / "twice.yaml")
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        load_config(None, ["eval.output={a: 1, a: 2}"])
    # the same key in two sections is fine
    (tmp_path / "ok.yaml").write_text("train:\n  steps: 3\noptim:\n  lr: 1e-4\n")
    cfg = load_config(tmp_path / "ok.yaml")
    assert cfg.train.steps == 3 and cfg.optim.lr == 1e-4


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_example_help_prints_usage_and_submits_nothing(tmp_path, flag):
    # PYTHON=false: had the script gone on to `megarl plan` or sbatch, it would fail (or create runs/)
    proc = subprocess.run(["bash", str(ROOT / "examples/qwen3-30b-a3b.sh"), "parallel.ep=8", flag],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": "false"})
    assert proc.returncode == 0, proc.stderr
    assert "DAPO on Qwen3-30B-A3B" in proc.stdout and "PLAN_ONLY=1 examples/qwen3-30b-a3b.sh" in proc.stdout
    assert "set -euo" not in proc.stdout and "shellcheck" not in proc.stdout
    assert not any(tmp_path.iterdir())


def test_train_and_eval_help_show_their_own_options(capsys):
    from megarl.cli import main

    for command, has_checkpoint in (("train", False), ("eval", True)):
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert f"usage: megarl {command}" in out and "--config" in out and "--nproc" in out
        assert ("--checkpoint" in out) == has_checkpoint


def test_plan_shows_a_tiny_models_size(tmp_path, capsys):
    import json

    from megarl.launch.plan import main
    from megarl.launch.plan_table import params
    from megarl.models.tiny import TinyShape, hf_config

    assert params(131_776) == "131.78 K" and params(32.76e9) == "32.76 B" and params(3.05e6) == "3.05 M"
    (tmp_path / "config.json").write_text(json.dumps(hf_config(TinyShape(family="qwen2"), eos_id=1, pad_id=0)))
    assert main(["--model", str(tmp_path), "--nodes", "1", "--gpus-per-node", "1"]) == 0
    out = capsys.readouterr().out  # one unit for the whole table: MiB, where a part would read 0.00 GiB
    assert "0.00 B" not in out and " K parameters" in out and "memory per GPU (MiB)" in out, out
    rows = out.split("memory per GPU (MiB)")[1].split("  total")[0]
    assert " GiB" not in rows.replace("GiB:", "").split("need")[0] and " 0.00 " not in rows, out
    assert main(["--model", str(tmp_path), "--nodes", "2", "--gpus-per-node", "1", "--cpu"]) == 0
    out = capsys.readouterr().out  # CPU processes (the tiny runs): no CUDA overhead, the whole table in MiB
    assert "2 nodes × 1 CPU process of 80 GiB" in out and "memory per process (MiB)" in out, out
    assert "runtime overhead" not in out and " GiB →" in out and "0.00 " not in out.split("memory per")[1], out


def test_make_tiny_model_offers_every_tiny_family():
    from megarl.models.tiny import FAMILIES as TINY_FAMILIES

    out = subprocess.run([sys.executable, "tools/make_tiny_model.py", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120).stdout
    assert all(f in out for f in TINY_FAMILIES), out


def test_keys_the_mode_does_not_read_are_said_before_launch(tmp_path, capsys):
    """A SortedRL key set with rollout.mode=sync (the mode forgotten, or one file run in several modes) did
    nothing, silently: the pre-launch check says so (and launches all the same)."""
    from megarl.launch.__main__ import main

    base = [f"model.path={tmp_path / 'model'}", "model.make_tiny=qwen2", f"train.run_dir={tmp_path / 'run'}"]
    assert main(["check", *base, "rollout.staleness_limit=3", "rollout.long_rounds=false"]) == 0
    err = capsys.readouterr().err
    assert ("rollout.staleness_limit=3 is not read in rollout.mode=sync with rollout.overlap=none (only in partial "
            "mode and with rollout.overlap=async)") in err, err
    assert "rollout.long_rounds=false is not read in rollout.mode=sync (only in on_policy mode)" in err
    # a model.path with no model (a typo) and model.make_tiny left set from a copied config: a random model
    assert f"model.path={tmp_path / 'model'} holds no model (no config.json): model.make_tiny=qwen2 makes" in err
    assert main(["check", *base, "rollout.mode=partial", "rollout.staleness_limit=3"]) == 0
    assert "not read" not in capsys.readouterr().err
    assert main(["check", *base, "rollout.mode=partial", "rollout.max_discards=4"]) == 0
    assert "rollout.max_discards=4 is not read in rollout.mode=partial" in capsys.readouterr().err
