"""tools/merge_lora.py on a small hand-written base (two shards and an index) and adapter: W + (alpha / r) · B @ A
in the base's dtype, shard by shard under the base's file names; and every bad input refused before anything is
written, naming the file or tensor (exit status 2). Against ``peft`` and a trainer's export:
``tests/distributed/test_lora_export.py``."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.scripts import ROOT

H, R, ALPHA = 8, 2, 6.0
P = "base_model.model."
Q, DOWN = "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"
SHARDS = {"model-00001-of-00002.safetensors": {f"{Q}.weight": (H, H), f"{Q}.bias": (H,),
                                                "model.embed_tokens.weight": (16, H)},
          "model-00002-of-00002.safetensors": {f"{DOWN}.weight": (H, 12), "model.norm.weight": (H,)}}


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("merge_lora", ROOT / "tools/merge_lora.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_base(path, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": H}))
    (path / "tokenizer.json").write_text("{}")
    weight_map = {}
    for file, shapes in SHARDS.items():
        save_file({k: torch.randn(*s, generator=g).to(dtype) for k, s in shapes.items()}, str(path / file),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shapes, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def make_adapter(path, base, tensors=None, **config):
    g = torch.Generator().manual_seed(1)
    if tensors is None:
        tensors = {f"{P}{Q}.lora_A.weight": (R, H), f"{P}{Q}.lora_B.weight": (H, R),
                   f"{P}{DOWN}.lora_A.weight": (R, 12), f"{P}{DOWN}.lora_B.weight": (H, R)}
    path.mkdir()
    save_file({k: torch.randn(*s, generator=g) for k, s in tensors.items()}, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "target_modules": ["q_proj", "down_proj"],
           "base_model_name_or_path": str(base), **config}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


def test_merges_each_shard_into_the_same_layout(tool, tmp_path, capsys):
    base = make_base(tmp_path / "base")
    adapter = make_adapter(tmp_path / "adapter", base)
    assert tool.main(["--adapter", str(adapter), "--out", str(tmp_path / "out")]) == 0  # base: the adapter's
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} == {p.name for p in base.iterdir()}
    assert (out / "model.safetensors.index.json").read_text() == (base / "model.safetensors.index.json").read_text()
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    for file, shapes in SHARDS.items():
        before, after = load_file(str(base / file)), load_file(str(out / file))
        assert after.keys() == before.keys() == shapes.keys()
        for name, w in before.items():
            assert after[name].dtype == torch.bfloat16
            module = name.removesuffix(".weight")
            if f"{P}{module}.lora_A.weight" not in lora:
                assert torch.equal(after[name], w), name
                continue
            a, b = lora[f"{P}{module}.lora_A.weight"], lora[f"{P}{module}.lora_B.weight"]
            assert torch.equal(after[name], (w.float() + ALPHA / R * (b @ a)).to(torch.bfloat16)), name
    assert "merge_lora: merged 2 weights (r 2, alpha 6) into 2 shard(s)" in capsys.readouterr().out


def test_rslora_scales_by_the_square_root_of_the_rank(tool, tmp_path):
    base = make_base(tmp_path / "base", torch.float32)
    adapter = make_adapter(tmp_path / "adapter", tmp_path / "elsewhere", use_rslora=True)
    assert tool.main(["--adapter", str(adapter), "--out", str(tmp_path / "out"), "--base", str(base)]) == 0
    lora, file = load_file(str(adapter / "adapter_model.safetensors")), "model-00001-of-00002.safetensors"
    w, merged = load_file(str(base / file))[f"{Q}.weight"], load_file(str(tmp_path / "out" / file))[f"{Q}.weight"]
    delta = lora[f"{P}{Q}.lora_B.weight"] @ lora[f"{P}{Q}.lora_A.weight"]
    assert torch.allclose(merged, w + ALPHA / R**0.5 * delta, atol=1e-6)


def _bad(name, tmp_path):
    """(the adapter directory, the expected words) of the bad input ``name``."""
    base = make_base(tmp_path / "base")
    ad = tmp_path / "adapter"
    if name == "no config":
        make_adapter(ad, base)
        (ad / "adapter_config.json").unlink()
        return ad, [f"--adapter {ad}: no adapter_config.json"]
    if name == "bin weights":
        make_adapter(ad, base)
        (ad / "adapter_model.safetensors").rename(ad / "adapter_model.bin")
        return ad, ["no adapter_model.safetensors (it holds adapter_model.bin: only safetensors is read)"]
    if name == "not lora":
        return make_adapter(ad, base, peft_type="IA3"), ["peft_type 'IA3'; only LORA adapters merge"]
    if name == "dora":
        return make_adapter(ad, base, use_dora=True), ["use_dora is set; DoRA adapters are not merged"]
    if name == "module the base lacks":
        tensors = {f"{P}model.layers.0.self_attn.z_proj.lora_A.weight": (R, H),
                   f"{P}model.layers.0.self_attn.z_proj.lora_B.weight": (H, R)}
        return make_adapter(ad, base, tensors), [
            f"module model.layers.0.self_attn.z_proj has no weight in --base {base} "
            "(no tensor model.layers.0.self_attn.z_proj.weight)"]
    if name == "rank mismatch":
        tensors = {f"{P}{Q}.lora_A.weight": (R + 1, H), f"{P}{Q}.lora_B.weight": (H, R + 1)}
        return make_adapter(ad, base, tensors), [f"{Q}: lora_A [3, 8], lora_B [8, 3] are of rank 3 / 3; "
                                                 "adapter_config.json says r = 2"]
    if name == "shape mismatch":
        tensors = {f"{P}{DOWN}.lora_A.weight": (R, H), f"{P}{DOWN}.lora_B.weight": (H, R)}
        return make_adapter(ad, base, tensors), [f"{DOWN}.weight: the base's is [8, 12], the adapter's B @ A is [8, 8]"]
    if name == "A without B":
        return make_adapter(ad, base, {f"{P}{Q}.lora_A.weight": (R, H)}), [
            f"{P}{Q}.lora_A.weight has no lora_B beside it"]
    if name == "not a lora tensor":
        return make_adapter(ad, base, {f"{P}model.embed_tokens.lora_embedding_A": (R, 16)}), [
            f"tensor {P}model.embed_tokens.lora_embedding_A is not a LoRA A or B of a linear layer"]
    if name == "base missing":
        return make_adapter(ad, tmp_path / "gone"), [f"base_model_name_or_path {tmp_path / 'gone'} is not a local "
                                                     "directory: pass --base"]
    if name == "base shard missing":
        (base / "model-00002-of-00002.safetensors").unlink()
        return make_adapter(ad, base), [f"--base {base}: ", "names 1 file(s) that are not there",
                                        "model-00002-of-00002.safetensors"]
    if name == "dist checkpoint's hf/":  # a run from hf-to-mcore's output: its hf/ has no weights
        (tmp_path / "ckpt").mkdir()
        (tmp_path / "ckpt" / "metadata.json").write_text("{}")
        hf = tmp_path / "ckpt" / "hf"
        hf.mkdir()
        (hf / "config.json").write_text("{}")
        return make_adapter(ad, hf), [f"--base {hf} is a megatron dist checkpoint's hf/ (config and tokenizer, no "
                                      f"weights): convert the checkpoint (python tools/convert_checkpoint.py "
                                      f"mcore-to-hf --ckpt {tmp_path / 'ckpt'} --out DIR) and pass --base DIR"]
    raise AssertionError(name)


@pytest.mark.parametrize("name", ["no config", "bin weights", "not lora", "dora", "module the base lacks",
                                  "rank mismatch", "shape mismatch", "A without B", "not a lora tensor",
                                  "base missing", "base shard missing", "dist checkpoint's hf/"])
def test_bad_input_is_refused_naming_the_file_or_tensor(tool, tmp_path, capsys, name):
    adapter, expected = _bad(name, tmp_path)
    assert tool.main(["--adapter", str(adapter), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("merge_lora: error: ")
    for text in expected:
        assert text in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_out_must_be_a_new_directory(tool, tmp_path, capsys):
    base = make_base(tmp_path / "base")
    adapter = make_adapter(tmp_path / "adapter", base)
    assert tool.main(["--adapter", str(adapter), "--out", str(base)]) == 2
    assert f"--out {base} exists: name a new directory" in capsys.readouterr().err
