"""MoE routing replay (``algo.routing_replay``): routes captured from real vLLM CPU engines, replayed by the
megatron-core trainer at every layout, carried through the partial buffer, run checkpoints and a kill -9 resume."""

from __future__ import annotations

import signal
import sys

import pytest

from helpers.runs import final_state, tiny_partial_run, train
from helpers.scripts import run_script
from megarl.logging.metrics import deterministic_view, read_metrics

TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
SLOW = pytest.mark.slow  # (a 2-process trainer each: the default run keeps TP 2 + SP)
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """Tiny MoE models and the routes an engine captured for them: fp32 (agrees with the fp32 trainer) and bf16
    (its rounding flips some routes), with half the samples aborted and resumed."""
    from megarl.models.tiny import TinyShape, make_tiny_model

    root, out = tmp_path_factory.mktemp("routes"), {}

    def capture(family: str, dtype: str):
        if (family, dtype) not in out:
            model = root / family
            if not model.exists():
                make_tiny_model(model, TinyShape(family=family), seed=3)
            samples = root / f"{family}-{dtype}.pt"
            report = run_script(["tests/workers/route_capture_checks.py", str(model), str(samples), dtype], env=ENV)
            out[family, dtype] = model, samples, report
        return out[family, dtype]

    return capture


_REPLAYS: dict = {}


def replay(captured, family: str, dtype: str, layout: str = "single") -> dict:
    if (family, dtype, layout) not in _REPLAYS:
        model, samples, _ = captured(family, dtype)
        launcher = [] if layout == "single" else TORCHRUN
        _REPLAYS[family, dtype, layout] = run_script(
            [*launcher, "tests/workers/routing_checks.py", str(model), str(samples), layout], env=ENV)
    return _REPLAYS[family, dtype, layout]


def test_the_engine_captures_every_routed_position_and_a_resumed_sample_keeps_its_earlier_routes(captured):
    *_, report = captured("qwen3_moe", "float32")
    assert report["samples"] == 8 and report["interrupted"] >= 1
    assert report["lengths_ok"], "routes must cover exactly the trainer's input positions (prompt + response - 1)"
    assert report["kept"], "a resumed sample's re-prefilled positions must keep the routes of its first request"
    assert report["dtype"] == "uint8" and report["shape"] == [4, 2] and 0 <= report["max_id"] < 4
    assert report["prefix_caching"] is False  # cached prompt rows are never routed


def test_replay_changes_nothing_where_the_engine_and_trainer_agree(captured):
    r = replay(captured, "qwen3_moe", "float32")
    assert r["checked"] > 1000 and r["differ"] == 0
    assert r["agreement"] == 1.0 and r["flip_tokens"] == 0.0
    assert r["replay_vs_own_max"] <= 1e-6
    assert r["gap_own"][1] < 1e-5 and r["gap_replayed"][1] < 1e-5


def test_a_bf16_engine_flips_routes_and_replay_routes_every_token_to_the_engines_experts(captured):
    r = replay(captured, "qwen3_moe", "bfloat16")
    assert r["differ"] == 0, "every token must be dispatched to exactly the engine's experts"
    assert r["agreement"] < 1.0 and r["flip_tokens"] > 0.0  # the trainer's own routes differ somewhere
    assert r["step_agreement"] is not None and r["step_loss"] is not None  # a training step replays too
    assert r["gap_replayed"][0] < r["gap_own"][0] and r["gap_replayed"][1] < r["gap_own"][1]
    # R2: the trainer's own routes recorded on every rank, replayed: its logprobs unchanged, agreement 1
    assert r["r2_vs_own_max"] == 0.0 and r["r2_agreement"] == 1.0 and r["r2_unrouted"] == 0
    assert r["r2_recording_pass_vs_replayed_max"] == 0.0  # what rl_update reuses as the proximal logprobs
    assert r["held_vs_replayed_max"] == 0.0 and r["exchanged_vs_replayed_max"] <= 1e-5
    assert 0 < r["r3_held"][0] < r["full_bytes"]  # one process holds every row, to its end (no padding)


def test_an_engines_other_tp_ranks_take_no_routes_where_vllm_would_assert():
    """A colocated engine of TP > 1 on GPUs: every rank runs vLLM's scheduler, and only the first TP rank's worker
    returns route rows; vLLM's own scheduler connector fails each other rank's first step. Patched, it takes none
    there (the first rank's outputs carry the routes: ``compat.vllm.routes_on_first_tp_rank``), and still takes
    exactly vLLM's rows where the worker gave them, and still fails where the worker output lacks a request."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector, AuxRequestOutput
    from vllm.v1.request import Request

    from megarl.compat.vllm import scheduler_takes_no_missing_rows

    request = Request("r", [5, 6, 7], SamplingParams(max_tokens=4), None)
    request.append_output_token_ids([8, 9])  # positions 0..3 fed: 4 rows
    rows = np.arange(4 * 3 * 2, dtype=np.uint8).reshape(4, 3, 2)
    connector = AuxOutputSchedulerConnector()
    with pytest.raises(AssertionError, match="auxiliary output worker output is missing r"):
        connector.take_output(request, None)  # what every TP rank but the first met
    expected = connector.take_output(request, {"r": AuxRequestOutput(0, rows)})
    scheduler_takes_no_missing_rows(connector)
    assert connector.take_output(request, None) is None
    assert np.array_equal(connector.take_output(request, {"r": AuxRequestOutput(0, rows)}), expected)
    assert expected.shape == (4, 3, 2)
    with pytest.raises(AssertionError, match="auxiliary output worker output is missing r"):
        connector.take_output(request, {"other": AuxRequestOutput(0, rows)})


@pytest.mark.parametrize("layout", ["tp2_sp", pytest.param("pp2", marks=SLOW), pytest.param("pp2_vpp2", marks=SLOW),
                                    pytest.param("ep2_alltoall", marks=SLOW), pytest.param("dp2", marks=SLOW)])
def test_replay_is_the_same_at_every_layout(captured, layout):
    one, got = replay(captured, "qwen3_moe", "bfloat16"), replay(captured, "qwen3_moe", "bfloat16", layout)
    assert got["differ"] == 0 and got["checked"] == one["checked"]
    for key in ("agreement", "flip_tokens", "agreement_in_replayed_pass", "r2_routes", "r2_shape"):
        assert got[key] == one[key], key
    received = [set(r) for r in got["r2_received"]]  # R2: each rank receives its own pipeline stage's layers
    assert set().union(*received) == set(range(4))
    assert not (received[0] & received[1]) if layout.startswith("pp2") else received[0] == received[1]
    for key in ("gap_own", "gap_replayed"):
        assert got[key] == pytest.approx(one[key], abs=1e-6), key
    # each rank holds its share of R2's and the engine's routes only (its rows at DP 2, its stage's layers at PP 2,
    # its sequence chunk at TP 2 + SP): together exactly what one process holds; the rest is fetched per pass
    for key in ("r2_held", "r3_held"):
        assert sum(got[key]) == sum(one[key]) and max(got[key]) < 0.7 * sum(one[key]), (key, got[key], one[key])
    assert got["held_vs_replayed_max"] == 0.0  # replaying the held share = replaying the batch's whole tensor
    assert got["sent_as_held"] == [True, True]  # each rank's share sent by rank 0 (the rollout leader) is the same
    assert got["exchanged_vs_replayed_max"] <= 1e-5  # rows trained on other ranks than hold their routes


@pytest.mark.parametrize("family", [pytest.param("qwen2_moe", marks=SLOW), pytest.param("mixtral", marks=SLOW)])
def test_replay_in_other_moe_families(captured, family):
    """Qwen2-MoE: a shared expert and a dense middle layer (``mlp_only_layers``: no routes; the layers after it one
    column to the left); Mixtral's names. Replay brings the trainer's logprobs nearer the engine's on average; the
    largest gap may sit on a position no route flip reaches (bf16 rounding alone: Qwen2-MoE's 0.006, the same in
    both passes), so only the mean is compared."""
    *_, report = captured(family, "bfloat16")
    assert report["lengths_ok"] and report["shape"] == ([3, 2] if family == "qwen2_moe" else [4, 2])
    r = replay(captured, family, "bfloat16")
    assert r["differ"] == 0 and r["flip_tokens"] > 0.0  # (the engine's routes differ from the trainer's somewhere)
    assert r["gap_replayed"][0] < r["gap_own"][0]


@pytest.mark.slow  # (its own engine: ~20 s on a quiet 2-core host; tests/unit/test_routes.py keeps the bookkeeping)
def test_requests_preempted_mid_prefill_get_the_routes_of_an_unpreempted_run(tmp_path):
    """A tiny KV cache, prompts longer than the batched-token budget, more slots than the cache holds: vLLM preempts
    requests, one of them mid-prefill with rows held and no output yet; a Qwen2-MoE written by transformers with a
    dense layer in the middle (``mlp_only_layers=[1]``: vLLM's layer 1 is no column of the routes)."""
    from helpers.hf_models import make_hf_model

    model = make_hf_model(tmp_path / "model", "qwen2_moe_dense1")
    r = run_script(["tests/workers/route_preemption_checks.py", str(model), "14"], env=ENV)
    assert r["preempted"] >= 1 and r["restarts"] >= 1, "the scenario must preempt a request mid-prefill"
    assert r["lengths_ok"] and r["same_tokens"] and r["same_routes"]
    assert r["layers"] == [0, 2, 3] and r["shape"] == [3, 2] and r["prefix_caching"] is False


def _run_args(model, run_dir, *extra):
    return tiny_partial_run(model, run_dir, 4, "model.make_tiny=qwen3_moe", "algo.routing_replay=rollout",
                            "trainer.precision=bf16", "algo.entropy_coef=0.01", *extra)


@pytest.mark.slow  # (every MoE run of the default suite captures and replays: the demo config is MoE)
def test_a_partial_run_replays_logs_agreement_and_checkpoints_the_buffers_routes(tmp_path):
    run = tmp_path / "run"
    train(_run_args(tmp_path / "model", run), run)
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "loss/policy" in r]
    assert len(steps) == 4 and all(0.5 < r["moe/route_agreement"] <= 1.0 for r in steps)
    assert all(0.0 <= r["moe/route_flip_tokens"] <= 1.0 for r in steps)
    live = [s for _, samples, *_ in final_state(run)["controller"]["live"].values() for s in samples
            if s.response_ids]
    assert live, "the partial buffer should hold unfinished samples at the end of a step"
    for s in live:  # every position the engine fed, routed: prompt + response - 1
        assert len(s.route_array()) == len(s.prompt_ids) + len(s.response_ids) - 1


@pytest.mark.slow
def test_kill_9_and_resume_restores_the_routes_and_gives_the_same_metrics(tmp_path):
    base, killed = tmp_path / "base", tmp_path / "killed"
    train(_run_args(tmp_path / "model", base), base)
    args = _run_args(tmp_path / "model", killed)
    train(args, killed, env={"MEGARL_TEST_KILL": "optimizer_step@3:1"}, rc=-signal.SIGKILL)
    train(args, killed)
    got, ref = (read_metrics(r / "metrics.jsonl") for r in (killed, base))
    assert any("moe/route_agreement" in r for r in ref)
    assert [deterministic_view(r) for r in got] == [deterministic_view(r) for r in ref]


@pytest.mark.slow
@pytest.mark.parametrize("launch,placement", [
    ([], ["engine.placement=disaggregated"]),
    (["--nproc", "2"], ["engine.tensor_parallel_size=2", "parallel.ep=2"]),
    (["--nproc", "2"], ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    (["--nproc", "2"], ["parallel.pp=2"]),
    (["--nproc", "2"], ["parallel.pp=2", "parallel.vpp=2"]),
    (["--nproc", "2"], ["engine.placement=disaggregated"]),  # trainer DP 2, one replica of engine TP 1
], ids=["disaggregated", "colocated_engine_tp2_ep2", "tp2_sp", "pp2", "pp2_vpp2", "disaggregated_dp2"])
def test_a_run_replays_in_other_placements(tmp_path, launch, placement):
    run = tmp_path / "run"
    train([sys.executable, "-m", "megarl.cli", "train", "--config", "configs/tiny_cpu.yaml", *launch,
           f"model.path={tmp_path / 'model'}", f"train.run_dir={run}", "rollout.mode=partial", "train.steps=3",
           "trainer.precision=bf16", *placement], run)
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "loss/policy" in r]
    assert len(steps) == 3 and all(0.5 < r["moe/route_agreement"] <= 1.0 for r in steps)


@pytest.mark.slow  # (the default run checks the recording pass equals the replaying one: the bf16 test above)
def test_r2_reuses_its_recording_pass_as_the_proximal_logprobs(tmp_path):
    """R2 with a proximal policy: one forward-only pass (the recording) then the optimizer steps; the recording
    pass's logprobs equal a pass replaying what it recorded."""
    from megarl.models.tiny import TinyShape, make_tiny_model

    model = make_tiny_model(tmp_path / "model", TinyShape(family="qwen3_moe"), seed=3)
    r = run_script(["tests/workers/r2_update_checks.py", str(model)], env=ENV)
    assert r["recording_vs_replayed_max"] == 0.0
    assert r["passes"] == ["forward", "train", "train"]  # was a second forward-only pass, with the same routes
    assert r["loss"] is not None and "mismatch/kl" in r["mismatch_keys"]
