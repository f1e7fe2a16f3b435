import hashlib

import pytest
import torch

from helpers.scripts import run_script
from megarl.models.hf_adapter import (
    hf_to_megatron,
    megatron_to_hf,
    qkv_from_megatron,
    qkv_to_megatron,
)
from megarl.models.sharding import (
    RankCoords,
    global_name,
    grouped_expert_name,
    join_tp_shards,
    local_expert_name,
    shard_for_rank,
)
from megarl.models.tiny import FAMILIES as TINY_FAMILIES
from megarl.models.tiny import TinyShape, build_tokenizer, hf_config, make_tiny_model, random_weights

FAMILIES = list(TINY_FAMILIES)


def digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_tiny_checkpoint_is_deterministic_by_seed(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=1)
    b = make_tiny_model(tmp_path / "b", seed=1)
    c = make_tiny_model(tmp_path / "c", seed=2)
    assert digest(a) == digest(b) != digest(c)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).is_file()


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_checkpoint_loads_in_transformers(tmp_path, family):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_model(tmp_path / family, TinyShape(family=family))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("12+34:", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "12+34:"
    assert model(torch.tensor([ids])).logits.shape == (1, len(ids), len(tok))
    assert model.config.model_type == family


def test_tokenizer_is_byte_level_bpe_with_single_digits_and_chatml():
    tok = build_tokenizer(384)
    assert len(tok) == 384 and build_tokenizer(384).backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    text = "4073+958:3+8+0=11,7+5+1=13>5031"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # digits one by one; the scratchpad's punctuation sits between digits
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
    latex = r"The answer is \boxed{\frac{1}{2}} — ünïcode"
    ids = tok(latex, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(latex.encode()) and tok.decode(ids) == latex  # merges learnt; every byte round-trips
    chat = tok.apply_chat_template([{"role": "user", "content": "1+1:"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\n1+1:<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    with pytest.raises(ValueError, match="byte-level"):
        build_tokenizer(64)


def test_qkv_interleave_round_trip_and_layout():
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 8, "head_dim": 2}
    q, k, v = (torch.arange(16.).reshape(8, 2), 100 + torch.arange(8.).reshape(4, 2),
               200 + torch.arange(8.).reshape(4, 2))
    fused = qkv_to_megatron(q, k, v, cfg)
    # group 0 = q heads 0,1 (rows 0..3), k head 0 (rows 0..1), v head 0
    assert torch.equal(fused[:4], q[:4]) and torch.equal(fused[4:6], k[:2]) and torch.equal(fused[6:8], v[:2])
    for a, b in zip(qkv_from_megatron(fused, cfg), (q, k, v)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_megatron_round_trip_is_bit_exact(family):
    cfg = hf_config(TinyShape(family=family), eos_id=1, pad_id=0)
    hf = random_weights(cfg, seed=0, init_std=0.02)
    hf = {k: v + torch.randn_like(v) * 0.01 for k, v in hf.items()}  # non-trivial norms and biases
    back = dict(megatron_to_hf(hf_to_megatron(hf, cfg).items(), cfg))
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2)])
def test_shards_reassemble_to_the_full_model(tp, pp, ep):
    cfg = hf_config(TinyShape(family="qwen3_moe"), eos_id=1, pad_id=0)
    full = hf_to_megatron(random_weights(cfg, 0, 0.02), cfg)
    pieces: dict[str, list] = {}
    for p in range(pp):
        for e in range(ep):
            for t in range(tp):
                c = RankCoords(tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, ep_rank=e, ep_size=ep)
                for name, tensor in shard_for_rank(full, 4, 4, c).items():
                    pieces.setdefault(global_name(name, 4, 4, c), []).append((t, tensor))
    rebuilt = {}
    for name, parts in pieces.items():
        by_rank = dict(parts)
        if ".experts." in name:
            assert all(torch.equal(x, by_rank[0]) for x in by_rank.values())
            rebuilt[name] = by_rank[0]
        else:
            rebuilt[name] = join_tp_shards(name, [by_rank[t] for t in range(tp)])
    assert rebuilt.keys() == full.keys()
    assert all(torch.equal(rebuilt[k], full[k]) for k in full)


def test_megatron_logprobs_equal_transformers_for_every_family(tmp_path):
    """Routing (renormalised or not), Mixtral's names, Qwen2-MoE's gated shared expert and its
    dense ``mlp_only_layers`` layer all mean what transformers means by them, unpacked and packed (rows of several
    lengths, and rows of one length: the packed attention's two paths, grouped-query heads)."""
    gaps = run_script(["tests/workers/hf_parity_checks.py", str(tmp_path), *FAMILIES])
    assert gaps.keys() == set(FAMILIES)
    for family, g in gaps.items():
        assert g["scale"] > 1.0, family  # large random weights: a wrong path would show
        assert g["equal_rows"] == [13], family
        for gap in ("gap", "packed_gap", "equal_packed_gap"):
            assert g[gap] <= 1e-5 * g["scale"], (family, gap, g)


def test_mixtral_and_shared_expert_names():
    mixtral = hf_config(TinyShape(family="mixtral"), eos_id=1, pad_id=0)
    names = set(random_weights(mixtral, 0, 0.02))
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in names
    assert not any(".mlp." in n for n in names)
    meg = hf_to_megatron(random_weights(mixtral, 0, 0.02), mixtral)
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight" in meg
    assert "decoder.layers.0.mlp.router.weight" in meg
    qmoe = hf_config(TinyShape(family="qwen2_moe"), eos_id=1, pad_id=0)
    meg = hf_to_megatron(random_weights(qmoe, 0, 0.02), qmoe)
    middle = qmoe["num_hidden_layers"] // 2
    assert meg["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"].shape == (2 * 192, 128)
    assert meg["decoder.layers.0.mlp.shared_experts.gate_weight"].shape == (1, 128)
    assert f"decoder.layers.{middle}.mlp.linear_fc1.weight" in meg  # mlp_only_layers: dense
    assert not any(k.startswith(f"decoder.layers.{middle}.mlp.router") for k in meg)
    assert f"decoder.layers.{middle + 1}.mlp.router.weight" in meg  # MoE again after it


def test_transformer_engine_expert_names_map_to_the_local_spec():
    grouped = "decoder.layers.1.mlp.experts.linear_fc2.weight3"
    local = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
    assert local_expert_name(grouped) == local and grouped_expert_name(local) == grouped
    assert local_expert_name("decoder.layers.1.mlp.linear_fc1.weight") == "decoder.layers.1.mlp.linear_fc1.weight"


def test_math_defaults_of_a_config_that_leaves_keys_out_are_transformers_own():
    """A config.json without rms_norm_eps / norm_topk_prob / rope_theta means transformers' defaults for its family
    (Mixtral: eps 1e-5, theta 1e6; Qwen-MoE: no renormalisation), which the trainer and the identity check use."""
    from transformers import CONFIG_MAPPING

    from megarl.models.hf_config import SUPPORTED_MODEL_TYPES, norm_topk_prob, rms_norm_eps, rope_theta

    for family in SUPPORTED_MODEL_TYPES:
        theirs = CONFIG_MAPPING[family]()
        bare = {"model_type": family}
        assert rms_norm_eps(bare) == theirs.rms_norm_eps, family
        assert rope_theta(bare) == theirs.rope_parameters["rope_theta"], family
        if hasattr(theirs, "norm_topk_prob"):
            assert norm_topk_prob(bare) == theirs.norm_topk_prob, family
