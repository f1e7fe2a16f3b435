"""Packed micro-batches compute what unpacked rows compute (``trainer.packing``, ``trainer.max_tokens_per_microbatch``).

At each layout (one process, TP 2 + SP, PP 2, PP 2 × VPP 2, EP 2, DP 2; dense and MoE with routing replay), one
worker run builds an unpacked trainer, one packed by rows and one packed by tokens from the same weights, and gives
them the same batch (rows of 1 to 24 positions; the token budget is 24) over three steps, one per loss aggregation
(tests/workers/packing_checks.py): the logprobs (a critic's values), every step's loss, grad norm and metrics, the
weights after one step and R2's recorded routes agree (fp32: 1e-5 relative; bf16: within the bf16 gap
``docs/parallelism.md#precision-trainerprecision`` states).
"""

import pytest

from helpers.scripts import run_script
from megarl.models.tiny import TinyShape, make_tiny_model

SLOW = pytest.mark.slow
_RUNS: dict = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    return {f: make_tiny_model(root / f, TinyShape(family=f), seed=3) for f in ("qwen2", "qwen3_moe")}


def run(models, family, layout, head="lm", precision="fp32"):
    key = (family, layout, head, precision)
    if key not in _RUNS:
        launcher = [] if layout == "single" else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        _RUNS[key] = run_script([*launcher, "tests/workers/packing_checks.py", layout, str(models[family]), head,
                                 precision], env={"OMP_NUM_THREADS": "1"})
    return _RUNS[key]


def assert_packed_equals_unpacked(got, rel=1e-5):
    assert got["lengths"][:2] == [1, 24]  # a row of one position, a row as long as the token budget
    for name in ("rows", "tokens"):
        assert got["logprob_gap"][name] <= rel, (name, got["logprob_gap"])
        assert got["weight_gap"][name] <= rel, (name, got["weight_gap"])
        for i, step in enumerate(got["steps"]):
            ref, packed = step["unpacked"], step[name]
            assert packed.keys() == ref.keys(), (name, i)
            for key, value in ref.items():
                assert packed[key] == pytest.approx(value, rel=rel, abs=1e-7), (name, i, key)
    assert got["steps"][0]["unpacked"]["grad_norm"] > 0.01  # (the steps move the weights: not vacuous)
    if "r2_positions" in got:  # each packed trainer recorded the unpacked trainer's routes on every position
        assert got["r2_same"] == {n: got["r2_positions"] for n in ("unpacked", "rows", "tokens")}


def assert_rows_plan(got, layout):
    """The packed-by-rows trainer's micro-batches on rank 0: rows of similar length together (fewer, fuller attention
    groups), or the unpacked micro-batches where a micro-batch's make-up matters."""
    # rank 0's rows: all ten, or the first five at DP 2 (lengths 1, 24, 3, 17, 9 | 2, 12, 20, 5, 7)
    batch_order = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]] if got["dp"] == 1 else [[0, 1], [2, 3], [4]]
    longest_first = [[1, 7], [3, 6], [4, 9], [8, 2], [5, 0]] if got["dp"] == 1 else [[1, 3], [4, 2], [0]]
    plan = [mb for mb in got["rows_plan"] if mb]  # (less any padding-only micro-batch of the interleaved schedule)
    if got["pp"] > 1 or layout == "ep2_allgather":  # one micro-batch length: the longest would set every one's
        assert plan == batch_order
    else:
        assert plan == longest_first
    if "rows_plan_router" in got:  # the router losses read a micro-batch's make-up
        assert [mb for mb in got["rows_plan_router"] if mb] == batch_order


LAYOUTS = [("qwen2", "single"), ("qwen3_moe", "single"), ("qwen3_moe", "pp2_vpp2"),
           pytest.param("qwen2", "tp2_sp", marks=SLOW), pytest.param("qwen2", "pp2", marks=SLOW),
           pytest.param("qwen2", "pp2_vpp2", marks=SLOW), pytest.param("qwen2", "dp2", marks=SLOW),
           pytest.param("qwen3_moe", "tp2_sp", marks=SLOW), pytest.param("qwen3_moe", "pp2", marks=SLOW),
           pytest.param("qwen3_moe", "ep2_alltoall", marks=SLOW),
           pytest.param("qwen3_moe", "ep2_allgather", marks=SLOW), pytest.param("qwen3_moe", "dp2", marks=SLOW)]


@pytest.mark.parametrize("family,layout", LAYOUTS)
def test_packed_micro_batches_equal_unpacked_rows(models, family, layout):
    got = run(models, family, layout)
    assert got["world"] == (1 if layout == "single" else 2)
    if family == "qwen3_moe":  # routing replay on: the routes given with the batch were replayed
        assert "moe/route_agreement" in got["steps"][0]["unpacked"] and "r2_positions" in got
    assert_packed_equals_unpacked(got)
    assert_rows_plan(got, layout)


@pytest.mark.parametrize("layout", ["single", pytest.param("tp2_sp", marks=SLOW), pytest.param("pp2", marks=SLOW)])
def test_packed_critic_values_equal_unpacked(models, layout):
    got = run(models, "qwen2", layout, head="value")
    assert_packed_equals_unpacked(got)
    assert_rows_plan(got, layout)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_packed_bf16_stays_within_the_bf16_gap(models, family):
    """bf16: packed and unpacked differ by bf16 rounding only (precision tests: mean logprob gap < 0.01, loss and
    grad norm within 2%)."""
    got = run(models, family, "single", precision="bf16")
    for name in ("rows", "tokens"):
        assert got["logprob_mean_gap"][name] < 0.01, got["logprob_mean_gap"]
        for step in got["steps"]:
            for key in ("loss", "grad_norm"):
                assert step[name][key] == pytest.approx(step["unpacked"][key], rel=0.02), (name, key)
