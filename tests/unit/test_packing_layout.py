"""Packed micro-batches as data (megarl/algo/packing.py): the assignment's invariants and the pack/unpack spans."""

import random

import numpy as np
import pytest
import torch

from megarl.algo.batch import batch_routes, build_batch
from megarl.algo.packing import karmarkar_karp, pack, plan_microbatches, unpack
from megarl.types import no_route


def _rows(plan):
    return [r for bins in plan for b in bins for r in b.rows]


@pytest.mark.parametrize("by_length", [False, True])
@pytest.mark.parametrize("seed", range(20))
def test_token_balanced_plans_keep_their_invariants(seed, by_length):
    rng = random.Random(seed)
    n, dp, cap = rng.randint(1, 40), rng.choice([1, 2, 4]), rng.choice([64, 100, 257])
    lengths = [int(1 + rng.paretovariate(0.8) * 4) % cap + 1 for _ in range(n)]  # long-tailed, ≤ cap
    lengths[rng.randrange(n)] = cap  # a row exactly as long as the budget
    multiple, pp = rng.choice([1, 2]), rng.choice([1, 2])
    plan = plan_microbatches(lengths, dp=dp, max_tokens=cap, multiple=multiple, equal_length=pp > 1,
                             count_multiple=pp, by_length=by_length)
    assert len(plan) == dp
    assert sorted(_rows(plan)) == list(range(n))  # every row once
    counts = {len(bins) for bins in plan}
    assert len(counts) == 1 and counts.pop() % pp == 0  # the same number of micro-batches on every rank
    for bins in plan:
        for mb in bins:
            assert mb.tokens <= cap and mb.padded >= mb.tokens and mb.padded % multiple == 0
            assert mb.lengths == [lengths[r] for r in mb.rows]
            cu = mb.cu_seqlens()
            assert cu[0] == 0 and cu[-1] == mb.padded and len(cu) == len(mb.rows) + 1 + (mb.padded > mb.tokens)
    if pp > 1:
        assert len({mb.padded for bins in plan for mb in bins}) == 1
    loads = [sum(mb.tokens for mb in bins) for bins in plan]
    assert max(loads) - min(loads) <= max(lengths)  # equal token loads over DP ranks (up to one row)


def test_karmarkar_karp_balances_better_than_a_contiguous_split():
    lengths = {i: n for i, n in enumerate([100, 5, 90, 10, 80, 20, 70, 30, 60, 40, 50, 5])}  # 4 × 140 is possible
    parts = karmarkar_karp(lengths, 4)
    loads = sorted(sum(lengths[r] for r in p) for p in parts)
    assert sorted(r for p in parts for r in p) == list(lengths)
    assert loads[-1] - loads[0] <= 20, loads  # a heuristic: 135, 135, 140, 150
    contiguous = [sum(list(lengths.values())[i:i + 3]) for i in range(0, 12, 3)]
    assert max(contiguous) - min(contiguous) > loads[-1] - loads[0]


def test_without_a_token_budget_micro_batches_are_the_unpacked_ones():
    """``micro_batch_size`` rows each, contiguous over DP ranks, as the unpacked trainer cuts them; every rank gets
    as many micro-batches (a padding-only one where rows run out) and rows of length 0 carry nothing."""
    plan = plan_microbatches([5, 3, 0, 7, 2, 9, 4], dp=2, micro_batch_size=2)
    assert [[mb.rows for mb in bins] for bins in plan] == [[[0, 1], [3]], [[4, 5], [6]]]
    plan = plan_microbatches([5, 3, 4, 7, 2], dp=2, micro_batch_size=1, multiple=2)
    assert [[mb.rows for mb in bins] for bins in plan] == [[[0], [1], [2]], [[3], [4], []]]
    assert [mb.padded for mb in plan[1]] == [8, 2, 2]  # a padding-only micro-batch: the least a layout allows


def test_a_row_longer_than_the_budget_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"trainer.max_tokens_per_microbatch=16 .* row 1's 17 positions"):
        plan_microbatches([16, 17, 3], max_tokens=16)
    plan = plan_microbatches([16, 1, 1], max_tokens=16)  # exactly the budget, and rows of one position
    assert sorted(mb.tokens for mb in plan[0]) == [2, 16]


def test_pack_lays_rows_end_to_end_and_unpack_hands_each_row_its_span():
    g = torch.Generator().manual_seed(0)
    prompts = [[3, 4], [5], [6, 7, 8]]
    responses = [[9, 10, 11], [12], [13, 14]]
    batch = build_batch(prompts, responses, [[-1.0] * len(r) for r in responses], [0.5, -1.0, 2.0])
    routes = [np.full((4, 2, 2), i, dtype=np.uint8) for i in range(3)]
    batch.routes = batch_routes(routes, batch.seq_len)
    assert batch.lengths.tolist() == [4, 1, 4]
    (plan,) = plan_microbatches(batch.row_lengths(), micro_batch_size=3, multiple=4, equal_length=True)
    (layout,) = plan
    assert layout.padded == 12 and layout.cu_seqlens() == [0, 4, 5, 9, 12]
    mb = pack(batch.as_dict(), layout)
    assert mb["input_ids"].tolist() == [[3, 4, 9, 10, 5, 6, 7, 8, 13, 0, 0, 0]]
    assert mb["labels"].tolist() == [[4, 9, 10, 11, 12, 7, 8, 13, 14, 0, 0, 0]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 0, 0, 1, 2, 3, 0, 1, 2]]
    assert mb["cu_seqlens"].dtype == torch.int32 and int(mb["max_seqlen"]) == 4
    assert mb["routes"][0, :, 0, 0].tolist() == [0, 0, 0, 0, 1, 2, 2, 2, 2] + [no_route(torch.uint8)] * 3
    for key in ("loss_mask", "weights", "old_logprobs", "advantages"):  # per row, at the micro-batch's width
        assert torch.equal(mb[key], getattr(batch, key)[:, :4]), key
    values = torch.randn(1, 12, generator=g, requires_grad=True)
    rows = unpack(values, mb)
    assert rows.shape == (3, 4)
    assert rows[0].tolist() == values[0, :4].tolist() and rows[2].tolist() == values[0, 5:9].tolist()
    assert rows[1].tolist() == [values[0, 4].item(), 0.0, 0.0, 0.0]
    rows.sum().backward()  # differentiable: each packed position feeds its row's position once, padding nothing
    assert values.grad[0].tolist() == [1.0] * 9 + [0.0] * 3


def test_lengths_ride_along_row_selection_and_padding():
    batch = build_batch([[1, 2], [3]], [[4, 5, 6], [7]])
    assert batch.lengths.tolist() == [4, 1]
    assert batch.select(torch.tensor([1])).lengths.tolist() == [1]
    padded = batch.pad_rows(2).pad_columns(3)
    assert padded.lengths.tolist() == [4, 1, 0, 0] and padded.seq_len == batch.seq_len + 3
    assert padded.row_lengths() == [4, 1, 0, 0]


def test_the_token_budget_is_checked_before_launch_against_the_longest_row():
    from megarl.config import ConfigError, load_config, validate

    def check(*overrides):
        validate(load_config(None, ["engine.max_model_len=256", *overrides]), world_size=1)

    cfg = load_config(None, [])
    assert cfg.trainer.packing is True and cfg.trainer.max_tokens_per_microbatch == 0  # packed, by rows
    check("trainer.max_tokens_per_microbatch=255")  # a rollout's row holds at most max_model_len − 1 positions
    check("trainer.packing=false")
    with pytest.raises(ConfigError, match=r"trainer.max_tokens_per_microbatch=254 .*engine.max_model_len 256 .* 255"):
        check("trainer.max_tokens_per_microbatch=254")
    with pytest.raises(ConfigError, match=r"trainer.max_tokens_per_microbatch=512 .*trainer.packing=true"):
        check("trainer.max_tokens_per_microbatch=512", "trainer.packing=false")
    with pytest.raises(ConfigError, match=r"trainer.max_tokens_per_microbatch must be >= 0"):
        check("trainer.max_tokens_per_microbatch=-1")


def test_by_length_puts_rows_of_similar_length_in_one_micro_batch_on_each_rank():
    """Longest first within each DP rank's contiguous block, ``micro_batch_size`` rows each: no micro-batch holds
    more positions than ``micro_batch_size`` × the longest row (the unpacked trainer's micro-batch)."""
    lengths = [5, 30, 0, 7, 28, 2, 9, 31]
    plan = plan_microbatches(lengths, dp=2, micro_batch_size=2, by_length=True)
    assert [[mb.rows for mb in bins] for bins in plan] == [[[1, 3], [0]], [[7, 4], [6, 5]]]
    assert [[mb.lengths for mb in bins] for bins in plan] == [[[30, 7], [5]], [[31, 28], [9, 2]]]
    assert max(mb.padded for bins in plan for mb in bins) <= 2 * max(lengths)
    assert plan_microbatches(lengths, dp=2, micro_batch_size=2)[1][0].rows == [4, 5]  # (off: in batch order)


def test_by_length_token_budgets_cut_runs_of_similar_length_as_even_as_runs_allow():
    """By tokens, ``by_length``: the rank's rows longest first in as many runs as LPT needs (2 here), the heaviest
    run the lightest a cut gives (LPT mixes long and short rows in each); where no cut fits, LPT's bins."""
    lengths = [13, 40, 12, 39, 11, 38, 10, 37]
    (runs,) = plan_microbatches(lengths, max_tokens=120, by_length=True)
    assert sorted(mb.lengths for mb in runs) == [[37, 13, 12, 11, 10], [40, 39, 38]]  # 117 is the least heaviest
    (lpt,) = plan_microbatches(lengths, max_tokens=120)
    assert sorted(sorted(mb.lengths) for mb in lpt) == [[10, 13, 37, 40], [11, 12, 38, 39]]
    (tight,) = plan_microbatches(lengths, max_tokens=100, by_length=True)  # 2 runs would need 117 tokens
    assert sorted(sorted(mb.lengths) for mb in tight) == [[10, 13, 37, 40], [11, 12, 38, 39]]
