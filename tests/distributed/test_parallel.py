"""Every parallel layout computes what one process computes (real megatron-core, gloo, 2 processes).

For each layout and tiny model: the loss and per-token logprobs of a fixed batch, the grad
norm of one PPO step, and the full weights after that step equal the single-process run.
"""

import json

import pytest
import torch

from helpers.scripts import run_script
from megarl.models.tiny import TinyShape, make_tiny_model

SLOW = pytest.mark.slow  # (each layout is a 2-process run: the default run keeps one of each kind)
LAYOUTS = [
    pytest.param("qwen2", "tp2", marks=SLOW), ("qwen2", "tp2_sp"), pytest.param("qwen2", "tp2_full_logits", marks=SLOW),
    pytest.param("qwen2", "pp2", marks=SLOW), ("qwen2", "pp2_vpp2"), ("qwen2", "dp2"),
    pytest.param("qwen3_moe", "pp2_vpp2", marks=SLOW), pytest.param("qwen3_moe", "tp2_sp", marks=SLOW),
    ("qwen3_moe", "tp2_sp_etp1"), pytest.param("qwen3_moe", "pp2", marks=SLOW),
    pytest.param("qwen3_moe", "dp2", marks=SLOW), ("qwen3_moe", "ep2_alltoall"),
    pytest.param("qwen3_moe", "ep2_allgather", marks=SLOW), pytest.param("mixtral", "ep2_alltoall", marks=SLOW),
    pytest.param("qwen2_moe", "tp2_sp", marks=SLOW), ("qwen2_moe", "ep2_allgather"),
    pytest.param("qwen2_moe", "pp2", marks=SLOW),
]
_RUNS: dict = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    return {f: make_tiny_model(root / f, TinyShape(family=f), seed=3)
            for f in ("qwen2", "qwen3_moe", "mixtral", "qwen2_moe")}, root


def run(models, family, layout, head="lm", nproc=2):
    key = (family, layout, head)
    if key not in _RUNS:
        paths, root = models
        out = root / f"{family}-{layout}-{head}"
        launcher = [] if layout.startswith("single") else ["-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc-per-node={nproc}"]
        run_script([*launcher, "tests/workers/parallel_checks.py", layout, str(paths[family]), str(out), head],
                   env={"OMP_NUM_THREADS": "1"})
        _RUNS[key] = (json.loads((out / "result.json").read_text()), torch.load(out / "weights.pt"))
    return _RUNS[key]


def assert_same(ref, got, moved_from=None):
    (r, rw), (g, gw) = ref, got
    assert g["loss"] == pytest.approx(r["loss"], rel=1e-5)
    assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    assert g["grad_norms"] == pytest.approx([r["grad_norm"]] * g["world"], rel=1e-5)  # every rank clips by it
    a, b, mask = torch.tensor(r["logprobs"]), torch.tensor(g["logprobs"]), torch.tensor(r["mask"])
    assert a.shape == b.shape
    assert ((a - b).abs() * mask).max() <= 1e-5 * (a.abs() * mask).max()
    assert rw.keys() == gw.keys()
    for name in rw:
        assert (gw[name] - rw[name]).abs().max() <= 1e-5 * rw[name].abs().max().clamp(min=1e-3), name


@pytest.mark.parametrize("family,layout", LAYOUTS)
def test_layout_matches_single_process(models, family, layout):
    got = run(models, family, layout)
    assert got[0]["world"] == 2
    assert_same(run(models, family, "single"), got)


def test_one_step_moves_the_weights(models):
    from safetensors.torch import load_file

    from megarl.models.hf_adapter import hf_to_megatron

    paths, _ = models
    cfg = json.loads((paths["qwen2"] / "config.json").read_text())
    before = hf_to_megatron(load_file(str(paths["qwen2"] / "model.safetensors")), cfg)
    _, after = run(models, "qwen2", "single")
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert 5e-6 < moved < 1e-4  # one Adam step of lr 1e-5: the match above is not vacuous


@pytest.mark.parametrize("layout", ["tp2_sp", "pp2", "pp2_vpp2"])
def test_critic_forward_backward_matches_single_process(models, layout):
    ref = run(models, "qwen2", "single", head="value")
    got = run(models, "qwen2", layout, head="value")
    assert ref[0]["head"] == "value" and any(k.startswith("output_layer.") for k in ref[1])
    assert_same(ref, got)




def test_a_batch_with_fewer_rows_than_data_parallel_ranks_trains_as_one_process(models):
    """DP=2, one row: rank 1 had no row, built no microbatch and megatron's schedule raised StopIteration (its peer
    then died on a closed gloo connection)."""
    got = run(models, "qwen2", "dp2_one_row")
    assert got[0]["dp"] == 2 and len(got[0]["logprobs"]) == 1
    assert_same(run(models, "qwen2", "single_one_row"), got)


def test_padding_microbatches_do_not_dilute_the_metrics(models):
    ref, got = run(models, "qwen2", "single_mbs8"), run(models, "qwen2", "pp2_vpp2_mbs8")
    assert_same(ref, got)
    for key in ("clip_frac", "ratio_mean", "approx_kl"):
        assert got[0]["metrics"][key] == pytest.approx(ref[0]["metrics"][key], rel=1e-5), key


@pytest.mark.parametrize("layout", ["single_aux_loss", "single_z_loss"])
def test_router_losses_train_the_router_without_changing_the_logprobs(models, layout):
    (plain, plain_w), (routed, routed_w) = run(models, "qwen3_moe", "single"), run(models, "qwen3_moe", layout)
    assert routed["logprobs"] == plain["logprobs"]  # aux and z losses add gradients, not outputs
    router = [k for k in plain_w if k.endswith("mlp.router.weight")]
    assert router and max(float((routed_w[k] - plain_w[k]).abs().max()) for k in router) > 1e-6


@pytest.mark.parametrize("layout", ["single", pytest.param("tp2_sp", marks=SLOW), pytest.param("pp2", marks=SLOW)])
def test_padding_counts_for_nothing_in_the_router_losses(models, layout):
    """Router losses on: 12 more padding positions per row leave the routers' gradients as they were (megatron's
    ``padding_mask``); a micro-batch of padding rows alone (no token to balance) keeps the step finite. (Under
    sequence parallelism megatron's z loss is a mean of each TP rank's token mean: where the padding sits moves
    the valid tokens between the ranks' chunks, which weighs them differently; only the load-balancing loss there.)"""
    paths, _ = models
    launch = [] if layout == "single" else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    z_loss = "0" if layout == "tp2_sp" else "0.1"
    got = run_script([*launch, "tests/workers/router_padding_checks.py", str(paths["qwen3_moe"]), layout, z_loss],
                     env={"OMP_NUM_THREADS": "1"})
    assert got["routers"] >= 2 and got["scale"] > 1e-3
    assert got["padded_vs_plain_max"] <= 1e-5 * got["scale"]
    assert got["padding_rows_finite"] and got["padding_rows_skipped"] == 0.0


@pytest.mark.slow  # 22 s
def test_a_bf16_trainer_routes_in_fp32(models):
    """Under bf16 the routers take bf16 hidden states and score the experts in fp32 (``moe_router_dtype``): bf16
    scores tie where vLLM's fp32 ones do not, and flip routes (bench/routing_replay.py)."""
    paths, _ = models
    got = run_script(["tests/workers/router_dtype_checks.py", str(paths["qwen3_moe"]), "bf16_single"])
    assert got["calls"] >= 2 and got["inputs"] == ["torch.bfloat16"] and got["logits"] == ["torch.float32"], got


@pytest.mark.slow
def test_pipeline_times_data_parallel_logprobs_keep_every_rank_rows(models):
    """EP=2 × PP=2 on four processes (DP=2), one microbatch per DP rank padded for the pipeline: the logprobs
    are every DP rank's rows, not the first rank's rows and its padding (equal to one process's)."""
    got = run(models, "qwen3_moe", "ep2_pp2_mbs8", nproc=4)
    assert got[0]["world"] == 4 and got[0]["dp"] == 2 and got[0]["pp"] == 2
    assert_same(run(models, "qwen3_moe", "single_mbs8"), got)


@pytest.mark.slow
def test_expert_tp2_on_gloo_runs_the_allgather_dispatcher_and_matches_expert_tp1(models):
    """EP=2 × TP=2 (SP) on four processes, expert TP 2 asking for alltoall: megatron's alltoall all-gathers uneven
    token counts over the expert TP group, which gloo refuses; megarl runs allgather instead, said once, and the
    logprobs, loss, grad norm and stepped weights equal expert TP 1's and one process's."""
    (one, one_w), (two, two_w) = (run(models, "qwen3_moe", layout, nproc=4)
                                  for layout in ("ep2_tp2_etp1", "ep2_tp2_etp2"))
    assert (one["world"], one["ep"], one["tp"], one["etp"], one["dispatcher"]) == (4, 2, 2, 1, "alltoall")
    assert (two["world"], two["ep"], two["tp"], two["etp"], two["dispatcher"]) == (4, 2, 2, 2, "allgather")
    assert one["said"] == [] and len(two["said"]) == 1 and "parallel.etp=2" in two["said"][0]  # one line, rank 0
    assert_same((one, one_w), (two, two_w))  # logprobs, loss, every rank's grad norm, the weights after a step
    single = run(models, "qwen3_moe", "single")
    assert_same(single, (one, one_w))  # (the grad norm was 0.2% low at expert TP 1: count_expert_grads_once)
    assert_same(single, (two, two_w))


def test_moe_dispatcher_choice_on_gloo_and_nccl(monkeypatch):
    """alltoall at EP > 1 × expert TP > 1 on gloo → allgather with one logged line (rank 0, once); kept on NCCL,
    at expert TP 1 under EP > 1, and whatever else was asked for; at EP 1 × expert TP 1 (no communication either
    way) allgather, silently."""
    from dataclasses import replace

    from megarl.distributed import parallel
    from megarl.trainer import model

    monkeypatch.setattr(model, "_SAID", set())
    ps = parallel.ParallelState(world_size=4, rank=1, tp=2, pp=1, ep=2, etp=2, dp=2, vpp=1, sequence_parallel=True,
                                tp_rank=1, pp_rank=0, ep_rank=0, etp_rank=1, dp_rank=0)
    said = []
    assert model.moe_dispatcher_for("alltoall", ps, "gloo", said.append) == "allgather" and said == []  # rank 1
    ps = replace(ps, rank=0, tp_rank=0, etp_rank=0)
    for _ in range(2):  # a second trainer (critic, reference) in the process: no second line
        assert model.moe_dispatcher_for("alltoall", ps, "gloo", said.append) == "allgather"
    assert len(said) == 1 and "parallel.etp=2" in said[0] and "using 'allgather'" in said[0]
    for p, backend, asked in [(ps, "nccl", "alltoall"), (replace(ps, etp=1), "gloo", "alltoall"),
                              (replace(ps, ep=1), "gloo", "alltoall"), (ps, "gloo", "allgather")]:
        assert model.moe_dispatcher_for(asked, p, backend, said.append) == asked, (p, backend)
    for backend in ("gloo", "nccl"):
        assert model.moe_dispatcher_for("alltoall", replace(ps, ep=1, etp=1), backend, said.append) == "allgather"
    assert len(said) == 1
