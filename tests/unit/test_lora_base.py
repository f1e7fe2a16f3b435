"""A LoRA run from a megatron dist checkpoint: the engines, sent the adapters alone, start from the checkpoint's
weights converted to HF once into ``<run_dir>/base_hf`` (``convert/lora_base.py``; the worker runs the conversion in
a process of its own). The run itself: tests/distributed/test_start_from_dist.py (slow)."""

from helpers.hf_models import make_hf_model
from helpers.scripts import run_script


def test_a_lora_runs_base_is_the_dist_checkpoints_weights_converted_once(tmp_path):
    hf = make_hf_model(tmp_path / "qwen3", "qwen3", seed=3)
    out = run_script(["tests/workers/lora_base_checks.py", str(hf), str(tmp_path)], env={"OMP_NUM_THREADS": "1"})
    base = str(tmp_path / "run" / "base_hf")
    assert out["base"] == out["peer_got"] == out["engine_dir"] == base  # rank 1 waited for rank 0's conversion
    assert out["source"]["model.path"] == str((tmp_path / "ckpt").resolve()) and not out["starts_empty"]
    assert out["same_weights"] and out["tokenizer"]  # the HF model's tensors bit for bit, its tokenizer beside
    assert out["reused"] and out["remade"]  # a resumed run converts nothing again; a cut-short conversion is redone
    assert out["rewritten"]  # the checkpoint rewritten in place since: converted again
    assert f"{base} holds the HF weights of {(tmp_path / 'ckpt').resolve()}, not of model.path=" in out["refused"]
    assert out["full_run"] == [str(tmp_path / "ckpt" / "hf"), True]  # a full run: dummy weights, the trainer's synced
    assert out["hf_run"]  # an HF model.path: its own files
