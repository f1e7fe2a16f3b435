"""A rank's shards read slice by slice from the safetensors files (``megarl/models/hf_slices.py``) equal, bit for
bit, what the whole-file path cut for it: ``shard_for_rank(hf_to_megatron(every tensor))``, at every coordinate of
TP (even and uneven splits), PP, virtual stages, EP and expert TP, for dense, MoE, Mixtral, a shared expert, qkv
biases and tied embeddings; on transformers-written checkpoints in several files with an index."""

from __future__ import annotations

import itertools

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.hf_models import make_hf_model
from megarl.models.hf_adapter import hf_parts, hf_to_megatron
from megarl.models.hf_config import num_experts, read_hf_config
from megarl.models.hf_reader import HFCheckpoint
from megarl.models.hf_slices import ShardReader, chunk_range
from megarl.models.sharding import RankCoords, grouped_expert_name, shard_for_rank

# (tp, pp, virtual stages, ep, expert tp): TP 2, an uneven TP 3 (vocab, query groups and columns cut mid-way, as
# torch.chunk cuts them), PP 2, PP 2 × 2 virtual stages, EP 2 with expert TP 1 and 2 beside TP 2
LAYOUTS = [(2, 1, 1, 1, 2), (3, 1, 1, 1, 3), (1, 2, 1, 1, 1), (1, 2, 2, 1, 1), (2, 1, 1, 2, 1), (2, 1, 1, 2, 2)]
FAMILIES = ["qwen3", "llama_tied_llama3", "qwen2_yarn", "qwen3_moe", "mixtral", "qwen2_moe", "qwen2_moe_dense1"]


def every_rank(tp: int, pp: int, vp: int, ep: int, etp: int):
    for t, p, v, e, et in itertools.product(range(tp), range(pp), range(vp), range(ep), range(etp)):
        yield RankCoords(t, tp, p, pp, e, ep, et, etp, v, vp)


def whole(model_dir) -> dict[str, torch.Tensor]:
    hf = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        hf.update(load_file(str(f)))
    return hf


def megatron_full(model_dir, cfg) -> dict[str, torch.Tensor]:
    full = hf_to_megatron(whole(model_dir), cfg)
    if cfg.get("tie_word_embeddings"):
        full["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    return full


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("slices")
    return {f: make_hf_model(root / f, f, seed=5, max_shard_size="300KB") for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_rank_reads_exactly_the_shards_the_whole_file_path_cut(checkpoints, family):
    model_dir = checkpoints[family]
    assert (model_dir / "model.safetensors.index.json").is_file()  # several files
    cfg = read_hf_config(model_dir)
    full = megatron_full(model_dir, cfg)
    reader = ShardReader(model_dir, cfg, block_bytes=4096)  # small blocks: column splits in several reads
    checked = 0
    for layout in LAYOUTS:
        for c in every_rank(*layout):
            want = shard_for_rank(full, cfg["num_hidden_layers"], num_experts(cfg), c)
            for name, t in want.items():
                plan = reader.plan(name, c)
                assert plan is not None and plan.shape == tuple(t.shape), (name, c)
                got = reader.read(plan)
                assert got.dtype == t.dtype and torch.equal(got, t), (name, c)
                checked += 1
    assert checked > 500


def test_row_splits_read_only_their_rows(checkpoints):
    """Every piece that is not a column split reads exactly the shard's bytes, nothing more; a column split reads
    its tensor's rows once."""
    model_dir = checkpoints["qwen3_moe"]
    cfg = read_hf_config(model_dir)
    reader = ShardReader(model_dir, cfg)
    c = RankCoords(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2, etp_rank=0, etp_size=2)
    names = shard_for_rank({n: t for n, t in megatron_full(model_dir, cfg).items()},
                           cfg["num_hidden_layers"], num_experts(cfg), c)
    for name in names:
        plan = reader.plan(name, c)
        read = sum(p.stop - p.start for p in plan.pieces)
        if plan.pieces[0].columns is None:
            assert read == plan.shape[0], name
        else:
            assert len(plan.pieces) == 1 and read == reader.files.entries[plan.pieces[0].name][2][0], name
    qkv = reader.plan("decoder.layers.0.self_attention.linear_qkv.weight", c)  # 4 heads, 2 groups: group 1
    assert [(p.name.split(".")[-2], p.start, p.stop, p.at) for p in qkv.pieces] == [
        ("q_proj", 64, 128, 0), ("k_proj", 32, 64, 64), ("v_proj", 32, 64, 96)]


def test_a_bf16_checkpoint_reads_into_fp32_parameters_as_copy_casts(tmp_path):
    """Into a destination of another dtype: block by block, cast as ``Tensor.copy_`` (the old ``.to``) casts."""
    model_dir = make_hf_model(tmp_path / "m", "qwen2_moe", seed=2, dtype=torch.bfloat16)
    cfg = read_hf_config(model_dir)
    full = megatron_full(model_dir, cfg)
    reader = ShardReader(model_dir, cfg, block_bytes=1000)
    for c in every_rank(2, 1, 1, 2, 1):
        for name, t in shard_for_rank(full, cfg["num_hidden_layers"], num_experts(cfg), c).items():
            out = torch.full(t.shape, float("nan"), dtype=torch.float32)
            reader.read(reader.plan(name, c), out=out)
            assert torch.equal(out, t.to(torch.float32)), (name, c)


def test_transformer_engine_names_read_what_the_local_spec_names_read(checkpoints):
    """TE's spec fuses the pre-attention norm into linear_qkv and groups the experts' GEMMs; those parameter names
    read the same tensors as the local spec's."""
    model_dir = checkpoints["qwen3_moe"]
    cfg = read_hf_config(model_dir)
    reader = ShardReader(model_dir, cfg)
    c = RankCoords(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, ep_rank=1, ep_size=2, etp_rank=1, etp_size=2)
    local = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    for te, ours in [(grouped_expert_name(local), local),
                     ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                      "decoder.layers.0.input_layernorm.weight")]:
        assert te != ours and reader.plan(te, c) == reader.plan(ours, c) is not None
        assert torch.equal(reader.read(reader.plan(te, c)), reader.read(reader.plan(ours, c)))


def test_hf_parts_name_the_sources_as_the_checkpoint_spells_them():
    mixtral = {"model_type": "mixtral"}
    assert hf_parts("decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight", mixtral) == (
        "fc1", ("model.layers.2.block_sparse_moe.experts.3.w1.weight",
                "model.layers.2.block_sparse_moe.experts.3.w3.weight"))
    assert hf_parts("decoder.layers.0.mlp.router.weight", mixtral) == (
        "one", ("model.layers.0.block_sparse_moe.gate.weight",))
    assert hf_parts("output_layer.weight", {"tie_word_embeddings": True}) == ("one", ("model.embed_tokens.weight",))
    assert hf_parts("output_layer.weight", {}) == ("one", ("lm_head.weight",))
    qkv_bias = hf_parts("decoder.layers.1.self_attention.linear_qkv.bias", {})
    assert qkv_bias == ("qkv", tuple(f"model.layers.1.self_attn.{n}_proj.bias" for n in "qkv"))
    with pytest.raises(KeyError, match="no HF name"):
        hf_parts("decoder.layers.0.mlp.something.weight", {})


def test_missing_files_tensors_and_rows_are_errors_that_name_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        HFCheckpoint(tmp_path)
    model_dir = make_hf_model(tmp_path / "m", "qwen3", seed=1)
    cfg = read_hf_config(model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    reader = ShardReader(model_dir, cfg)
    assert reader.plan("decoder.layers.1.self_attention.linear_qkv.weight", RankCoords()) is None
    assert reader.plan("decoder.layers.0.self_attention.linear_qkv.weight", RankCoords()) is not None
    with pytest.raises(ValueError, match=r"rows \[4, 9\) of model.norm.weight"):
        reader.files.read_rows("model.norm.weight", 4, 9, out=torch.empty(5, dtype=torch.float16))
    (model_dir / "model.safetensors").rename(model_dir / "weights.bin")
    with pytest.raises(FileNotFoundError, match=f"no \\*.safetensors files in model directory {model_dir}"):
        ShardReader(model_dir, cfg)


def test_chunk_range_is_torch_chunk():
    for n, size in [(384, 2), (384, 3), (256, 3), (10, 4), (7, 7), (5, 4)]:
        chunks = torch.chunk(torch.arange(n), size)
        for rank in range(size):
            start, stop = chunk_range(n, size, rank)
            want = chunks[rank].tolist() if rank < len(chunks) else []
            assert list(range(start, stop)) == want, (n, size, rank)
