"""Model families as transformers writes them: tied embeddings, RoPE scaling, and refusals.

Checkpoints come from transformers' own ``from_config`` + ``save_pretrained`` (``tests/helpers/hf_models.py``).
"""

import json

import pytest
import torch

from helpers.scripts import run_script
from megarl.models.hf_config import ROPE_TYPES, check_model_math, check_sequence_length, read_hf_config

PARITY = ["llama_tied_llama3", "qwen3", "qwen3_tied", "mistral", "llama_linear", "qwen2_yarn"]
SCALED = {"llama_tied_llama3", "llama_linear", "qwen2_yarn"}


def test_trainer_logprobs_equal_transformers(tmp_path):
    """Tied embeddings and llama3 / linear / YaRN RoPE scaling give transformers' logprobs, unpacked and packed; a
    trainer ignoring the scaling would be off by nats (``rope_effect``), so the comparison can fail."""
    got = run_script(["tests/workers/family_checks.py", "parity", str(tmp_path), *PARITY])
    assert got.keys() == set(PARITY)
    for name, g in got.items():
        assert g["scale"] > 1.0, name
        assert g["gap"] <= 1e-4 and g["packed_gap"] <= 1e-4, (name, g)
        if name in SCALED:
            assert g["rope_effect"] > 0.5, (name, g)


def engine_case(tmp_path, name):
    r = run_script(["tests/workers/family_checks.py", "engine", str(tmp_path), name])
    assert r["tokens"] > 40
    assert r["gap_before"] <= 1e-4, r
    assert r["moved"] > 1e-4  # the step changed the weights that were synced
    assert r["gap_after"] <= 1e-4, r
    return r


def test_tied_llama3_model_matches_vllm_before_and_after_sync(tmp_path):
    r = engine_case(tmp_path, "llama_tied_llama3")
    assert "lm_head.weight" not in r["names"] and "model.embed_tokens.weight" in r["names"]  # one tensor


def test_qwen2_moe_of_narrow_experts_matches_vllm_before_and_after_sync(tmp_path):
    """Qwen2-MoE with routed experts 48 wide, which vLLM's CPU MoE kernel pads to its block (64) at start: every
    sync used to fail ("size of tensor a (128) must match ... (96)": vLLM's reload skips the experts' padding), the
    engine serving its first weights for the whole run."""
    engine_case(tmp_path, "qwen2_moe")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "mistral", "qwen2_yarn", "llama_linear", "qwen3_tied"])
def test_family_matches_vllm_before_and_after_sync(tmp_path, name):
    engine_case(tmp_path, name)


@pytest.mark.parametrize("layout", ["pp2", pytest.param("tp2", marks=pytest.mark.slow)])
def test_tied_embedding_under_model_parallelism(tmp_path, layout):
    """PP = 2: the last stage holds a copy of the embedding as its output layer; both stages'
    gradients are summed into it, so after a step the copy still equals the embedding and the
    weights equal the single-process run's."""
    from helpers.hf_models import make_hf_model

    model = make_hf_model(tmp_path / "m", "llama_tied_llama3", seed=3)
    res = {}
    for lay in ("single", layout):
        launcher = [] if lay == "single" else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        run_script([*launcher, "tests/workers/parallel_checks.py", lay, str(model), str(tmp_path / lay)],
                   env={"OMP_NUM_THREADS": "1"})
        res[lay] = (json.loads((tmp_path / lay / "result.json").read_text()), torch.load(tmp_path / lay / "weights.pt"))
    (r, rw), (g, gw) = res["single"], res[layout]
    assert g["loss"] == pytest.approx(r["loss"], rel=1e-5)
    assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    a, b, mask = torch.tensor(r["logprobs"]), torch.tensor(g["logprobs"]), torch.tensor(r["mask"])
    assert ((a - b).abs() * mask).max() <= 1e-5 * (a.abs() * mask).max()
    assert "output_layer.weight" not in rw
    if layout == "pp2":
        assert torch.equal(gw.pop("output_layer.weight"), gw["embedding.word_embeddings.weight"])
    assert rw.keys() == gw.keys()
    for name in rw:
        assert (gw[name] - rw[name]).abs().max() <= 1e-5 * rw[name].abs().max().clamp(min=1e-3), name


@pytest.mark.parametrize("rope,message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type 'dynamic'"),
    ({"rope_type": "longrope", "factor": 2.0}, "rope_scaling.rope_type 'longrope'"),
])
def test_unsupported_rope_is_refused_at_config_time(tmp_path, rope, message):
    cfg = {"model_type": "llama", "rope_parameters": {**rope, "rope_theta": 1e4}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message) as err:
        read_hf_config(tmp_path)
    assert str(tmp_path) in str(err.value) and all(t in str(err.value) for t in ROPE_TYPES)


def test_legacy_rope_scaling_key_is_read():
    with pytest.raises(ValueError, match="'dynamic'"):
        check_model_math({"model_type": "llama", "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    check_model_math({"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}})


@pytest.mark.parametrize("key,value", [("attention_bias", True), ("mlp_bias", True), ("use_qk_norm", True),
                                       ("qk_layernorm", True), ("hidden_act", "gelu"),
                                       ("partial_rotary_factor", 0.5)])
def test_math_changing_keys_are_refused(key, value):
    with pytest.raises(ValueError, match=key):
        check_model_math({"model_type": "llama", key: value})


def test_sliding_window_is_refused_only_when_it_cuts_the_sequence():
    mistral = {"model_type": "mistral", "sliding_window": 4096}
    check_sequence_length(mistral, 4096)
    with pytest.raises(ValueError, match="sliding_window=4096 .* 8192"):
        check_sequence_length(mistral, 8192)
    check_sequence_length({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": False}, 4096)
    with pytest.raises(ValueError, match="sliding_window=64"):
        check_sequence_length({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True}, 128)


def test_sliding_window_is_a_config_error_before_launch(tmp_path):
    from helpers.hf_models import make_hf_model
    from megarl.config import ConfigError, load_config, validate

    model = make_hf_model(tmp_path / "m", "mistral", sliding_window=64)
    cfg = load_config(None, [f"model.path={model}", "engine.max_model_len=128"])
    with pytest.raises(ConfigError, match="sliding_window=64"):
        validate(cfg, 1, read_hf_config(model))
