"""Context parallelism's data (``parallel.cp``): which positions of a pack each CP rank holds, the packed layout with
rows padded to 2·CP, a micro-batch's split, and the layout rules refused before launch."""

import pytest
import torch

from megarl.algo.packing import PackedLayout, pack, plan_microbatches, split_for_context_parallel
from megarl.config import load_config
from megarl.distributed.context import chunk_positions, gathered_order
from megarl.models.tiny import TinyShape, hf_config

MOE = hf_config(TinyShape(family="qwen3_moe"), eos_id=1, pad_id=0)  # 4 heads, 2 kv, 4 layers, 4 experts


def test_each_rank_holds_chunks_i_and_2cp_minus_1_minus_i_of_every_segment():
    cu = [0, 8, 12]  # a row of 8 positions, then one of 4 (chunks of 2 and of 1 at CP 2)
    index0, within0 = chunk_positions(cu, 2, 0)
    index1, within1 = chunk_positions(cu, 2, 1)
    assert index0.tolist() == [0, 1, 6, 7, 8, 11] and within0.tolist() == [0, 1, 6, 7, 0, 3]
    assert index1.tolist() == [2, 3, 4, 5, 9, 10] and within1.tolist() == [2, 3, 4, 5, 1, 2]
    inverse = gathered_order(cu, 2)  # rank 0's local pack, then rank 1's: back in pack order
    assert torch.cat([index0, index1])[inverse].tolist() == list(range(12))
    assert chunk_positions(cu, 1, 0)[1].tolist() == [*range(8), *range(4)]
    with pytest.raises(ValueError, match="multiple of 2·CP = 4"):
        chunk_positions([0, 6], 2, 0)


def test_rows_are_padded_to_2cp_each_and_the_budget_counts_the_padding():
    layout = PackedLayout([3, 0], [5, 1], 12, row_multiple=4)
    assert layout.segments == [8, 4] and layout.cu_seqlens() == [0, 8, 12] and layout.tokens == 6
    plans = plan_microbatches([1, 24, 3, 17], max_tokens=24, row_multiple=4, multiple=4)
    for mb in plans[0]:  # every row's segment a multiple of 4, every micro-batch within the budget with them
        assert sum(mb.segments) <= 24 and mb.padded % 4 == 0 and all(s % 4 == 0 for s in mb.segments)
    assert sorted(r for mb in plans[0] for r in mb.rows) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"row 1's 23 positions \(24 padded to a multiple of 4\)"):
        plan_microbatches([1, 23], max_tokens=22, row_multiple=4)


def test_a_micro_batch_split_over_cp_ranks_keeps_rows_whole_and_owns_each_position_once():
    from megarl.algo.batch import build_batch

    batch = build_batch([[5, 6], [7]], [[8, 9, 10, 11], [12]])  # rows of 5 and 1 input positions
    layout = plan_microbatches(batch.row_lengths(), micro_batch_size=2, row_multiple=4, multiple=4)[0][0]
    mb = pack(batch.as_dict(), layout)
    assert mb["cu_seqlens"].tolist() == [0, 8, 12] and mb["position_ids"][0].tolist() == [*range(8), *range(4)]
    parts = [split_for_context_parallel(mb, 2, r) for r in range(2)]
    own = torch.stack([p["cp_own"] for p in parts])
    assert (own.sum(0) == mb["valid"]).all()  # every real position computed by exactly one rank
    for p in parts:
        assert p["input_ids"].shape == (1, 6) and p["labels"].shape == (1, 6)
        assert p["loss_mask"].shape == mb["loss_mask"].shape  # per-row fields stay whole
    gathered = torch.cat([p["labels"][0] for p in parts])[parts[0]["cp_inverse"]]
    assert gathered.tolist() == mb["labels"][0].tolist()  # labels shifted in pack order, then cut
    assert parts[0]["padding"][0].tolist() == [False, False, True, True, False, True]  # row 0's 5th..8th: padding



QWEN3_30B_LONG = ["--model", "examples/models/qwen3-30b-a3b.json", "--nodes", "4", "--gpus-per-node", "8",
                  "--gpu-mem-gib", "80", "--prompt-tokens", "512", "--response-tokens", "16384",
                  "rollout.max_new_tokens=16384", "engine.max_model_len=16896", "engine.slots=64",
                  "engine.kv_cache_gib=12", "trainer.max_tokens_per_microbatch=67584", "trainer.recompute=none"]
"""Qwen3-30B-A3B on 4 × 8 GPUs, 16k-token responses, four such rows a micro-batch, no activation recompute: at CP 1
no layout fits (tests/unit/test_plan_recompute.py)."""


def test_a_plan_sizes_a_cp_rank_at_1_over_cp_and_proposes_cp_for_long_responses(capsys, monkeypatch):
    import json

    from helpers.scripts import ROOT
    from megarl.launch.layout import Layout
    from megarl.launch.memory import memory_gib
    from megarl.launch.model_size import count_params
    from megarl.launch.plan import main

    monkeypatch.chdir(ROOT)
    hf = json.loads((ROOT / "examples/models/qwen3-30b-a3b.json").read_text())
    cfg = load_config(None, ["trainer.max_tokens_per_microbatch=67584", "trainer.precision=bf16",
                             "optim.logprob_chunk=0"])
    mem = {cp: memory_gib(count_params(hf), hf, cfg, Layout(4, 8, tp=2, pp=2, sequence_parallel=True, cp=cp), "bf16")
           for cp in (1, 4)}
    for part in ("activations", "logits"):  # a CP rank holds a quarter of a micro-batch's positions
        assert mem[4][part] == pytest.approx(mem[1][part] / 4)
    assert mem[4]["optimizer"] == mem[1]["optimizer"]  # (sharded over DP × CP = world / (TP × PP) either way)
    assert Layout(4, 8, tp=2, pp=2, cp=4).dp == 2 and Layout(4, 8, tp=2, pp=2, cp=4).dp_cp == 8

    assert main([*QWEN3_30B_LONG, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["fits"] and res["layout"]["cp"] > 1 and f"parallel.cp={res['layout']['cp']}" in res["overrides"]
    assert res["step_time"]["train"]["cp_s"] > 0  # its key/value traffic is in the step time
    assert main([*QWEN3_30B_LONG, "parallel.cp=1", "--json"]) == 1  # the config's CP alone when it sets the key
