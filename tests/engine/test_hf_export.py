"""A run ends with a model you can use: the policy exported as an HF checkpoint."""

from helpers.hf_models import make_hf_model
from helpers.scripts import run_script


def test_exported_policy_gives_the_trainers_logprobs_in_transformers(tmp_path):
    model = make_hf_model(tmp_path / "model", "llama_tied_llama3", seed=1)
    r = run_script(["tests/workers/export_checks.py", str(model), str(tmp_path)])
    assert r["moved"] > 1e-3  # the export holds the trained weights, not the starting ones
    assert r["gap"] <= 1e-4
    files = r["files"]
    assert "model.safetensors.index.json" in files and len([f for f in files if f.startswith("model-")]) > 2
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(files)
    assert not (tmp_path / "hf" / "step_1.tmp").exists()
    v = run_script(["tests/workers/export_checks.py", "vllm", str(tmp_path / "hf" / "step_1")])  # vLLM loads it as is
    assert v["tokens"] > 0 and v["gap"] <= 1e-4


def test_export_schedule(monkeypatch):
    from megarl.convert import export as hf_export

    calls = []
    monkeypatch.setattr(hf_export, "export_hf", lambda trainer, model_dir, out, max_shard_bytes: calls.append(
        (out.name, max_shard_bytes)))
    from megarl.config import load_config

    cfg = load_config(None, ["model.path=m", "train.export_hf_every=3", "train.export_shard_gib=0.5"])
    s = type("S", (), {"cfg": cfg, "trainer": None, "run_dir": "r"})
    for step in range(1, 8):
        hf_export.export_policy(s, step)
    hf_export.export_policy(s, 7, final=True)
    hf_export.export_policy(s, 6, final=True)  # a run whose last step was just exported
    assert calls == [("step_3", 2**29), ("step_6", 2**29), ("step_7", 2**29)]  # (train.export_shard_gib: 0.5)
