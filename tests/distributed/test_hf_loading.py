"""The trainer's load of an HF checkpoint on real megatron-core ranks (gloo, 2 processes): each rank reads only its
slices of the safetensors files (``megarl/models/hf_slices.py``), and gets, bit for bit, the parameters the
whole-file path gave it, at TP 2 + SP (experts split over expert TP), TP 2 with expert TP 1, PP 2, PP 2 × 2 virtual
stages, EP 2, into fp32 and bf16 parameters, for dense, MoE, Mixtral, a shared expert, qkv biases and tied
embeddings; and the host memory the load adds to a rank is its shard, not the checkpoint (peak RSS by Linux's
``VmHWM``, reset just before the load)."""

from __future__ import annotations

import pytest

from helpers.hf_models import make_hf_model
from helpers.scripts import run_script

CASES = [("qwen3_moe", "tp2_sp", "fp32"), ("qwen3_moe", "ep2_alltoall", "fp32"), ("qwen2_moe", "tp2_sp_etp1", "fp32"),
         ("qwen2_moe", "ep2_alltoall", "fp32"), ("llama_tied_llama3", "pp2_vpp2", "fp32"), ("mixtral", "pp2", "fp32"),
         ("qwen2_yarn", "tp2", "fp32"), ("qwen3", "tp2_sp", "bf16")]
# a checkpoint of ~200 MB in several files whose largest column-split tensor (8 MB) is small beside it: the ratio is
# the shard's half plus what is in flight
MEDIUM = dict(vocab_size=16384, hidden_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
              head_dim=128, intermediate_size=2048)
# over a gigabyte in several files (the embedding and the output layer, 512 MiB each, alone in theirs)
LARGE = dict(vocab_size=65536, hidden_size=2048, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
             head_dim=128, intermediate_size=4096)
MEMORY_ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}


def launch(checks: list[str], nproc: int = 2) -> dict:
    return run_script(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                       "tests/workers/load_checks.py", *checks], env=MEMORY_ENV)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    dirs = {f: make_hf_model(root / f, f, seed=4, max_shard_size="300KB") for f, _, _ in CASES}
    medium = make_hf_model(root / "medium", "qwen3", seed=0, max_shard_size="80MB", tokenizer=False, **MEDIUM)
    out = launch([f"memory:{medium}:tp2", *(f"exact:{dirs[f]}:{layout}:{p}" for f, layout, p in CASES)])
    return {(f, layout, p): out[f"exact:{dirs[f]}:{layout}:{p}"] for f, layout, p in CASES} | {
        "memory": out[f"memory:{medium}:tp2"]}


@pytest.mark.parametrize("case", CASES, ids=[":".join(c) for c in CASES])
def test_every_parameter_equals_what_the_whole_file_path_gave(results, case):
    ranks = results[case]
    assert len(ranks) == 2 and ranks[0]["coords"] != ranks[1]["coords"]  # two different shards
    for r in ranks:
        assert r["checked"] > 10 and r["wrong"] == [], r
        assert r["dtypes"] == [{"fp32": "float32", "bf16": "bfloat16"}[case[2]]]


def check_memory(ranks: list[dict], at_least_bytes: float) -> None:
    for r in ranks:
        ckpt = r["checkpoint_bytes"]
        assert ckpt >= at_least_bytes and r["files"] > 1 and r["same"], r
        assert r["shard_bytes"] <= r["sliced"] <= 0.6 * ckpt, r  # its shard (half at TP 2), a block beside it
        assert r["whole"] >= 1.0 * ckpt, r  # the whole-file path held every tensor of every file


def test_the_load_adds_a_ranks_shard_to_its_memory_not_the_checkpoint(results):
    check_memory(results["memory"], 150e6)


@pytest.mark.slow
def test_a_gigabyte_checkpoint_at_tp2_adds_at_most_six_tenths_of_it_per_rank(tmp_path):
    model = make_hf_model(tmp_path / "large", "qwen3", seed=0, max_shard_size="300MB", tokenizer=False, **LARGE)
    check_memory(launch([f"memory:{model}:tp2"])[f"memory:{model}:tp2"], 1e9)


@pytest.mark.slow
def test_four_ranks_at_ep2_with_expert_tp2_read_exactly_their_experts(tmp_path):
    """EP 2 × TP 2 with the experts split over expert TP 2 as well: four processes, each its own slice of each of
    its experts."""
    dirs = [make_hf_model(tmp_path / f, f, seed=6, max_shard_size="300KB") for f in ("qwen3_moe", "qwen2_moe")]
    layouts = {"ep2_tp2_etp2": 4, "ep2_tp2_etp1": 2}  # distinct shards: at expert TP 1 the TP group is the EP group
    checks = {f"exact:{d}:{layout}": shards for d in dirs for layout, shards in layouts.items()}
    out = launch(list(checks), nproc=4)
    for check, shards in checks.items():
        ranks = out[check]
        assert len({r["coords"][0] for r in ranks}) == shards, (check, ranks)
        assert all(r["checked"] > 10 and r["wrong"] == [] for r in ranks), (check, ranks)
