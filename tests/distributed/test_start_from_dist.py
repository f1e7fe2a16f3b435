"""``model.path`` set to ``tools/convert_checkpoint.py hf-to-mcore``'s output: a run starts from a megatron dist
checkpoint (docs/conversion.md#starting-a-run-from-a-dist-checkpoint).

The trainer loads it with megatron's dist checkpointing at its own layout (resharded on load), the engines start on
vLLM's dummy weights and serve the trainer's from the first sync; the config and tokenizer are the checkpoint's
``hf/``. A checkpoint of another model than that config, or one without ``hf/``, is refused before launch. A LoRA
run from it starts its engines from the checkpoint's weights converted to HF once (a LoRA sync sends the adapters
alone).
"""

import json
import shutil
import sys

import pytest

from helpers.conversion import convert
from helpers.hf_models import make_hf_model
from helpers.runs import scalars, train
from helpers.scripts import run_script


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    work = tmp_path_factory.mktemp("start_dist")
    model = make_hf_model(work / "llama", "llama_tied_llama3", seed=3)
    convert("hf-to-mcore", "--hf", model, "--out", work / "ckpt")
    return {"hf": model, "ckpt": work / "ckpt", "work": work}


def test_the_trainer_from_a_dist_checkpoint_holds_the_hf_weights_at_tp2(converted):
    out = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                      "tests/workers/start_from_dist_checks.py", "tp2", str(converted["hf"]), str(converted["ckpt"])],
                     env={"OMP_NUM_THREADS": "1"})
    for report in out["ranks"]:
        assert report["compared"] > 10 and report["differ"] == [], report
    assert all(r["head_zero"] for r in out["ranks"]) and sum(r["heads"] for r in out["ranks"]) > 0  # the value head


def _checked(ckpt, run_dir):
    from megarl.config.validate.prelaunch import checked_config

    overrides = [f"model.path={ckpt}", "model.make_tiny=", f"train.run_dir={run_dir}", "engine.max_model_len=96"]
    return checked_config("configs/tiny_cpu.yaml", overrides, nproc=1, command="train", notes=False)


def test_a_dist_checkpoint_is_refused_before_launch_when_its_config_is_another_model(converted, tmp_path):
    from megarl.config import ConfigError

    cfg = _checked(converted["ckpt"], tmp_path / "ok")  # its own config: accepted
    assert cfg.model.path == str(converted["ckpt"])
    other = make_hf_model(tmp_path / "qwen3", "qwen3", seed=1)
    wrong = tmp_path / "wrong"
    shutil.copytree(converted["ckpt"], wrong)
    shutil.copy(other / "config.json", wrong / "hf" / "config.json")
    with pytest.raises(ConfigError, match=rf"model.path={wrong}: .* holds another model than its {wrong / 'hf'}"):
        _checked(wrong, tmp_path / "run")
    shutil.rmtree(wrong / "hf")
    with pytest.raises(FileNotFoundError, match=rf"no config.json in {wrong / 'hf'} \(a megatron dist checkpoint"):
        _checked(wrong, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing launched


def _first_step(run_dir) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if "loss/policy" in r)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("parallel.tp=2",), ("parallel.pp=2",)], ids=["tp2", "pp2"])
def test_a_run_from_the_dist_checkpoint_trains_as_the_run_from_its_hf_directory(converted, layout):
    first = {}
    for name in ("hf", "ckpt"):
        run_dir = converted["work"] / f"run_{name}_{layout[0][-5:]}"
        train([sys.executable, "-m", "megarl.cli", "train", "--config", "configs/tiny_cpu.yaml", "--nproc", "2",
               f"model.path={converted[name]}", "model.make_tiny=", f"train.run_dir={run_dir}", "train.steps=2",
               "warmup.steps=0", "train.resume=never", "train.deterministic=true", "engine.max_model_len=96",
               "engine.tensor_parallel_size=2", *layout], run_dir)
        first[name] = _first_step(run_dir)
    hf, ckpt = first["hf"], first["ckpt"]
    assert ckpt["loss/policy"] == pytest.approx(hf["loss/policy"], rel=1e-6, abs=1e-9), (hf, ckpt)
    assert ckpt["loss/tokens"] == hf["loss/tokens"] and ckpt["loss/grad_norm"] == pytest.approx(hf["loss/grad_norm"],
                                                                                                 rel=1e-6)


@pytest.mark.slow  # (a `megarl train` run, ~30 s; tests/unit/test_lora_base.py is its fast representative)
def test_a_lora_run_from_the_dist_checkpoint_serves_its_weights_with_the_adapters(converted):
    """The engines start from ``<run_dir>/base_hf`` (the checkpoint converted), not dummy weights: every step's audit
    finds the engine serving the trainer's base with its synced adapters, and the PEFT export names that base."""
    run_dir = converted["work"] / "run_lora"
    out = train([sys.executable, "-m", "megarl.cli", "train", "--config", "configs/tiny_cpu.yaml",
                 f"model.path={converted['ckpt']}", "model.make_tiny=", f"train.run_dir={run_dir}", "train.steps=2",
                 "warmup.steps=0", "train.resume=never", "engine.max_model_len=96", "lora.rank=4", "lora.alpha=8",
                 "algo.entropy_coef=0.01", "sync.check_every=1"], run_dir)
    assert f"converting its weights to HF at {run_dir / 'base_hf'}" in out
    s = scalars(run_dir)
    assert s["engine/version"] == [1.0, 2.0] and max(s["sync/failures"]) == 0
    assert max(s["sync/logprob_gap"]) <= 1e-4  # (on dummy weights the audit's gap is ~10)
    adapter = json.loads((run_dir / "hf" / "step_2" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((run_dir / "base_hf").resolve())
