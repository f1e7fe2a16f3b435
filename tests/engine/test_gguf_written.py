"""``gguf-to-hf`` on GGUF files written the way llama.cpp's converter writes them (``helpers.gguf_files``) from
tiny checkpoints transformers built: what transformers' GGUF reader leaves out of the config (llama3 RoPE scaling in
``rope_freqs.weight``, the MoE expert sizes) must come back, or the file is refused naming it. The files hold F32
tensors, so the converted model must give the original's logits exactly."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.gguf_files import llama3_rope_divisors, write_gguf
from helpers.hf_models import make_hf_model


def _logits(model_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 384, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(ids).logits


def _round_trip(tmp_path, name: str, extra=None, **overrides):
    """(the original checkpoint, its GGUF converted back by megarl's gguf-to-hf in fp32)."""
    from megarl.convert.gguf import gguf_to_hf

    original = make_hf_model(tmp_path / name, name, **overrides)
    gguf_file = write_gguf(original, tmp_path / f"{name}.gguf", pre="smollm" if name.startswith("llama") else "qwen2",
                           extra=extra)
    return original, gguf_to_hf(gguf_file, tmp_path / "converted", torch.float32)


@pytest.mark.parametrize("rope,extra", [
    # the tiny model's own: a context of 32 so that 64 positions see the scaling
    (None, None),
    # the same with the factor and context length in the metadata as well
    (None, {"rope.scaling.factor": 8.0, "rope.scaling.original_context_length": 32}),
    # Llama 3.1's published values, at head_dim 128 and theta 500000 (the blend spans 6 of its 64 frequencies)
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192, "rope_theta": 500000.0}, None),
])
def test_llama3_rope_scaling_comes_back_from_rope_freqs(tmp_path, rope, extra):
    """(Before: the converted config had default RoPE and the logits differed by up to 12.9.)"""
    overrides = {} if rope is None else dict(rope_parameters=rope, max_position_embeddings=131072, head_dim=128,
                                             num_attention_heads=2, num_key_value_heads=1)
    original, converted = _round_trip(tmp_path, "llama_tied_llama3", extra, **overrides)
    want = json.loads((original / "config.json").read_text())["rope_parameters"]
    got = json.loads((converted / "config.json").read_text())["rope_parameters"]
    assert got == want and got["rope_type"] == "llama3"
    assert torch.equal(_logits(converted), _logits(original))


def test_a_rope_freqs_no_llama3_scaling_makes_is_refused_naming_the_file(tmp_path):
    from megarl.convert.gguf import gguf_to_hf

    original = make_hf_model(tmp_path / "llama", "llama_tied_llama3")
    rope = json.loads((original / "config.json").read_text())["rope_parameters"]
    divisors = llama3_rope_divisors(rope, 32)
    divisors[0] = 3.0  # the highest frequency divided: llama3 never touches it
    path = write_gguf(original, tmp_path / "odd.gguf", replace={"rope_freqs.weight": divisors})
    with pytest.raises(ValueError, match=r"odd\.gguf: rope_freqs\.weight \(16 divisors, max 8\) is not a llama3"):
        gguf_to_hf(path, tmp_path / "out", dry_run=True)
    # a factor in the metadata that the divisors contradict
    path = write_gguf(original, tmp_path / "factor.gguf", extra={"rope.scaling.factor": 4.0})
    with pytest.raises(ValueError, match=r"factor\.gguf: rope_freqs\.weight .*tried factor 4 with"):
        gguf_to_hf(path, tmp_path / "out", dry_run=True)


@pytest.mark.parametrize("name,sizes", [
    ("qwen2_moe", dict(moe_intermediate_size=40, shared_expert_intermediate_size=72)),
    ("qwen3_moe", dict(moe_intermediate_size=40)),
])
def test_moe_expert_sizes_come_back_from_expert_feed_forward_length(tmp_path, name, sizes):
    """(Before: transformers' defaults, 1408/5632 and 768, went into config.json beside 40-row experts.)"""
    original, converted = _round_trip(tmp_path, name, **sizes)
    config = json.loads((converted / "config.json").read_text())
    assert {key: config[key] for key in sizes} == sizes
    assert torch.equal(_logits(converted), _logits(original))


def test_an_expert_size_the_tensors_contradict_is_refused_naming_the_key(tmp_path):
    from megarl.convert.gguf import gguf_to_hf

    original = make_hf_model(tmp_path / "moe", "qwen3_moe", moe_intermediate_size=40)
    path = write_gguf(original, tmp_path / "moe.gguf")
    for key, value in (("expert_feed_forward_length", 40), ("expert_count", 4)):  # (what the writer wrote)
        assert _metadata(path, f"qwen3moe.{key}") == value
    bad = write_gguf(original, tmp_path / "bad.gguf", extra={"expert_feed_forward_length": 48})
    with pytest.raises(ValueError, match=r"bad\.gguf: qwen3moe\.expert_feed_forward_length is 48 but "
                                         r"blk\.0\.ffn_gate_exps\.weight has 40 rows"):
        gguf_to_hf(bad, tmp_path / "out", dry_run=True)


def test_an_moe_file_with_a_dense_layer_is_refused_naming_it(tmp_path):
    """(GGUF has no key for Qwen-MoE's ``mlp_only_layers``: transformers would make every layer MoE.)"""
    from megarl.convert.gguf import gguf_to_hf

    original = make_hf_model(tmp_path / "moe", "qwen2_moe_dense1")
    path = write_gguf(original, tmp_path / "dense.gguf")
    with pytest.raises(ValueError, match=r"dense\.gguf: layer 1 has no routed experts \(no blk\.1\.ffn_gate_exps"):
        gguf_to_hf(path, tmp_path / "out", dry_run=True)


def test_a_tensor_the_config_contradicts_or_lacks_is_refused_naming_it(tmp_path):
    """transformers 5 loads a tensor of another shape than its config's as it is (the checkpoint written would not
    load back) and leaves a weight the file lacks randomly initialised."""
    from megarl.convert.gguf import gguf_to_hf

    original = make_hf_model(tmp_path / "llama", "llama_tied_llama3")
    path = write_gguf(original, tmp_path / "ffn.gguf", extra={"feed_forward_length": 100})
    with pytest.raises(ValueError, match=r"ffn\.gguf: model\.layers\.0\.mlp\.gate_proj\.weight has shape \(192, 128\) "
                                         r"but the config read from the file makes it \(100, 128\)"):
        gguf_to_hf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
    # a weight the file lacks would be left as transformers initialises it
    path = write_gguf(original, tmp_path / "norm.gguf", replace={"blk.1.attn_norm.weight": None})
    with pytest.raises(ValueError, match=r"norm\.gguf: no tensor in the file for 1 of the model's weights "
                                         r"\(model\.layers\.1\.input_layernorm\.weight\)"):
        gguf_to_hf(path, tmp_path / "out")


def _metadata(path, key):
    from gguf import GGUFReader

    return GGUFReader(path).fields[key].contents()
