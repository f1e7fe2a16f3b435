"""``rollout.overlap``: generation beside training, real runs of ``megarl train`` with disaggregated replicas.

A tiny dense model, partial rollout, 4 RL steps, a checkpoint every 2. ``one_step`` is deterministic (a kill -9 and
resume gives the metrics of the uninterrupted run); ``async`` keeps every trained token within k versions, loses
no prompt across a kill -9, loads weights while a phase runs, and with k = 0 gives ``none``'s results exactly.
"""

from __future__ import annotations

import pickle
import re
import signal

import pytest

from helpers.runs import final_state, no_prompt_lost_or_twice, tiny_partial_run, train
from megarl.logging.metrics import deterministic_view, read_metrics

STEPS = 4


def _args(model, run_dir, *extra):
    return tiny_partial_run(model, run_dir, STEPS, "engine.placement=disaggregated", *extra)


def _train(model, run_dir, *extra, **kw):
    return train(_args(model, run_dir, *extra), run_dir, **kw)


def _steps(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss/policy" in r]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megarl.models.tiny import TinyShape, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("overlap") / "model", TinyShape(family="qwen2"), seed=3)


@pytest.fixture(scope="module")
def one_step(model, tmp_path_factory):
    ref = tmp_path_factory.mktemp("one_step") / "ref"
    _train(model, ref, "rollout.overlap=one_step")
    return ref


def test_one_step_trains_each_batch_one_version_after_the_weights_that_sampled_it(one_step):
    """Staleness exactly 1 from the second step on (the first batch is generated before any update), and no batch is
    generated for a step the run will not train."""
    steps = _steps(one_step)
    assert len(steps) == STEPS and steps[0]["rollout/staleness_max"] == 0
    assert all(r["rollout/staleness_max"] == 1 and r["rollout/staleness_mean"] > 0 for r in steps[1:])
    assert all("mismatch/abs_max" in r for r in steps)  # the decoupled objective's proximal forward: the default here
    state = final_state(one_step)
    assert state["pipeline"]["generated"] == STEPS and state["pipeline"]["done"] == STEPS  # none past the last step
    no_prompt_lost_or_twice(state)


@pytest.mark.slow
def test_one_step_is_deterministic_and_a_kill_9_resumes_exactly(model, one_step, tmp_path):
    """A run killed in step 3's optimizer step, resumed from step 2's checkpoint (the batch generated ahead in
    it), writes the metrics of the uninterrupted run (itself a second run of the same config)."""
    ref = one_step
    run = tmp_path / "run"
    _train(model, run, "rollout.overlap=one_step", env={"MEGARL_TEST_KILL": "optimizer_step@3"},
           rc=-signal.SIGKILL)
    out = _train(model, run, "rollout.overlap=one_step")
    assert "resumed from" in out and "step_000002" in out
    assert [deterministic_view(r) for r in read_metrics(run / "metrics.jsonl")] == \
        [deterministic_view(r) for r in read_metrics(ref / "metrics.jsonl")]
    no_prompt_lost_or_twice(final_state(run))


@pytest.mark.slow  # (two runs, 43 s: async's bound stays in the default run under failed syncs, kill -9 in test_resume)
def test_async_two_replicas_bound_staleness_load_in_flight_and_lose_nothing_across_a_kill_9(model, tmp_path):
    k = 1
    run = tmp_path / "run"
    extra = ["rollout.overlap=async", f"rollout.staleness_limit={k}", "engine.replicas=2"]
    _train(model, run, *extra, env={"MEGARL_TEST_KILL": "optimizer_step@3"}, rc=-signal.SIGKILL)
    out = _train(model, run, *extra)
    assert "resumed from" in out
    steps = _steps(run)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["rollout/staleness_max"] <= k for r in steps)  # every trained token within k versions
    assert any(r["rollout/staleness_max"] == k for r in steps)  # (and overlap happened: generated ahead)
    no_prompt_lost_or_twice(final_state(run))


@pytest.mark.parametrize("fault", ["sync_error@2,sync_error@3",  # one of two replicas failing: 30 s, slow
                                   pytest.param("replica_load_error@2,replica_load_error@3", marks=pytest.mark.slow)],
                         ids=["every_replica", "one_of_two"])
def test_async_keeps_the_staleness_bound_when_syncs_fail_in_a_row(model, tmp_path, fault):
    """k = 1 and the syncs of steps 2 and 3 fail (on every replica, or on one of two): the engines serve old weights
    while the trainer moves on, and still no trained token is more than 1 version old (the pipeline gates phases on
    the version the engines serve, a sample finishing past the bound runs again, a phase generated at its turn
    first has the sync run again)."""
    run = tmp_path / "run"
    _train(model, run, "rollout.overlap=async", "rollout.staleness_limit=1", "engine.replicas=2",
           "train.save_every=0", env={"MEGARL_TEST_FAULT": fault})
    steps = _steps(run)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert steps[-1]["sync/failures"] >= 2  # the injected failures happened (and were contained)
    assert all(r["rollout/staleness_max"] <= 1 for r in steps), [r["rollout/staleness_max"] for r in steps]
    no_prompt_lost_or_twice(final_state(run))


@pytest.mark.slow
def test_async_loads_weights_while_a_phase_runs(model, tmp_path):
    """Longer answers than the update takes, and a trainer slower than one phase, faster than two (4 epochs over each
    batch): a sync finds a phase running while the trainer has a batch queued (so it does not wait for the phase's
    end), loads between two engine steps, and that phase's tokens carry two versions (the engine's version moved
    under its running samples)."""
    run = tmp_path / "run"
    _train(model, run, "rollout.overlap=async", "rollout.staleness_limit=2", "rollout.max_new_tokens=64",
           "rollout.samples_per_prompt=8", "train.steps=6", "train.save_every=0", "algo.ppo_epochs=4")
    steps = _steps(run)
    assert any(r["sync/in_flight"] == 1 for r in steps)
    assert any(r["rollout/phase_versions"] >= 2 for r in steps)
    assert all(r["rollout/staleness_max"] <= 2 for r in steps)


@pytest.mark.slow
def test_async_with_staleness_0_gives_the_results_of_no_overlap(model, tmp_path):
    """k = 0: a phase starts only once the step before it synced, so the same calls in the same order (k also
    bounds partial mode's resumed samples: both runs at 0)."""
    none, zero = tmp_path / "none", tmp_path / "zero"
    _train(model, none, "rollout.overlap=none", "rollout.staleness_limit=0")
    _train(model, zero, "rollout.overlap=async", "rollout.staleness_limit=0")
    assert [deterministic_view(r) for r in read_metrics(zero / "metrics.jsonl")] == \
        [deterministic_view(r) for r in read_metrics(none / "metrics.jsonl")]


def test_an_in_flight_update_recomputes_the_kv_of_running_requests(tmp_path):
    """A weight update that lands between two engine steps of a running request: the next token (and its logprob)
    is what the idle engine with the new weights gives for the same prompt and tokens as a new request, its KV all
    computed under them; that token carries the new version."""
    from helpers.scripts import run_script

    r = run_script(["tests/workers/inflight_checks.py", str(tmp_path)])
    n = r["tokens_before_update"]
    assert r["versions"][:n] == [0] * n and r["versions"][n] == 1
    assert r["after"][0] == r["fresh"][0], r
    assert abs(r["after"][1] - r["fresh"][1]) <= 1e-5, r


ASYNC = ("engine.placement=disaggregated", "rollout.overlap=async", "rollout.staleness_limit=1")
DEFAULT_PATH = ("engine.placement=colocated", "rollout.overlap=none", "rollout.mode=sync")  # (the schema's defaults)


def _preempted(model, tmp_path, layout=ASYNC) -> tuple:
    """SIGTERM to every process of a run (as Slurm signals a job step) while a phase runs long (a verifier of 2 s a
    call): async, the trainer waiting for a batch generated ahead; the default path, the trainer's own thread in the
    phase. The run dir, its overrides and its output."""
    import os
    import subprocess
    import time

    from helpers.runs import reap, start
    from helpers.scripts import TESTS

    run = tmp_path / "run"
    extra = [*layout, "reward.fn=helpers.reward_fns:slow_match", "reward.timeout_s=30", "train.save_every=0",
             "data.eval_size=1"]
    proc = start(tiny_partial_run(model, run, STEPS, *extra), env={"PYTHONPATH": str(TESTS), "SLOW_REWARD_S": "2"},
                 out=subprocess.PIPE)
    lines, sent, saved = [], 0.0, 0.0
    try:
        for line in proc.stdout:
            lines.append(line)
            if not sent and line.startswith("step 1/"):
                time.sleep(2)  # the phase of a batch ahead is in flight, its verifier calls seconds each
                os.killpg(proc.pid, signal.SIGTERM)
                sent = time.monotonic()
            if sent and "checkpoint saved, stopping" in line:
                saved = time.monotonic()
        assert proc.wait(timeout=300) == 0, "".join(lines)[-4000:]
    finally:
        reap(proc)
    return run, extra, "".join(lines), saved - sent if saved else None


@pytest.mark.slow  # (63 s; the default run keeps the default path's, and checkpoint windows' pause)
@pytest.mark.alone  # saved within 10 s: never beside another test
def test_a_preemption_under_async_saves_within_seconds_while_a_long_phase_runs(model, tmp_path):
    """The wait for the batch ends, the phase in flight is paused between two engine steps (the bound: one engine
    step; the groups it completed are scored outside it) and saved with the checkpoint (its samples so far, its
    groups released so far), the run exits 0 long before the phase would have ended, and no prompt is lost."""
    run, _, out, took = _preempted(model, tmp_path)
    phase_s = float(re.search(r"timing/gen_s ([0-9.]+)", out).group(1))  # how long a phase of this run takes
    assert took is not None and took < min(10.0, phase_s / 2), (took, phase_s, out[-3000:])
    assert "SIGTERM received; checkpoint saved, stopping" in out and "eval after RL" not in out
    state = final_state(run)
    no_prompt_lost_or_twice(state)
    assert any(x.response_ids for _, samples, *_ in state["controller"]["live"].values() for x in samples)


@pytest.mark.alone  # saved within 10 s: never beside another test
def test_a_preemption_on_the_default_path_saves_within_seconds_while_a_long_phase_runs(model, tmp_path):
    """Colocated engines, no overlap: the trainer's own thread runs the phase, which stops between two engine steps
    at the signal; the controller as it was before that phase is saved (its drawn prompts re-queued: they run again
    after the resume), the run exits 0 long before the phase would have ended, and no prompt is lost."""
    run, _, out, took = _preempted(model, tmp_path, DEFAULT_PATH)
    phase_s = float(re.search(r"timing/gen_s ([0-9.]+)", out).group(1))
    assert took is not None and took < min(10.0, phase_s / 2), (took, phase_s, out[-3000:])
    assert "step 1: SIGTERM received; checkpoint saved, stopping" in out and "eval after RL" not in out
    state = final_state(run)
    assert state["step"] == 1
    no_prompt_lost_or_twice(state)
    assert state["controller"]["requeued"]  # the stopped phase's prompts, first in the next one


@pytest.mark.slow  # (the preempted run resumed to its end)
def test_a_run_preempted_under_async_mid_phase_resumes_to_the_end_losing_nothing(model, tmp_path):
    from helpers.scripts import TESTS

    run, extra, _, _ = _preempted(model, tmp_path)
    train(tiny_partial_run(model, run, STEPS, *extra), run, env={"PYTHONPATH": str(TESTS), "SLOW_REWARD_S": "0"})
    no_prompt_lost_or_twice(final_state(run))
    assert [r["step"] for r in _steps(run)][-1] == STEPS


@pytest.mark.slow
def test_a_run_a_failed_sync_stopped_resumes_its_pipeline_at_the_step_it_trained(model, tmp_path):
    """async at k = 0, a replica killed right before step 2's sync audit and engine.max_restarts=0: the sync stops
    the run with a checkpoint of step 2 (its update made) and exit 75. The pipeline is saved at that step too, so the
    resumed run generates its next batch and trains to the end (its pipeline one step behind, the resumed trainer
    waited forever for a batch no phase would start)."""
    run = tmp_path / "run"
    extra = ["rollout.overlap=async", "rollout.staleness_limit=0", "sync.check_every=1", "engine.replicas=2",
             "train.save_every=0"]
    out = _train(model, run, *extra, "engine.max_restarts=0",
                 env={"MEGARL_TEST_FAULT": "replica_dies_before_audit@2"}, rc=75)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000002", out[-3000:]
    state = final_state(run)
    assert state["step"] == 2 and state["pipeline"]["done"] == 2, state["pipeline"]
    out = _train(model, run, *extra, timeout=300)
    assert "resumed from" in out and [r["step"] for r in _steps(run)][-1] == STEPS
    no_prompt_lost_or_twice(final_state(run))


@pytest.mark.slow
@pytest.mark.alone  # a 20 s hang timeout: never beside another test
def test_async_evaluates_every_step_under_a_short_watchdog(model, tmp_path):
    """An evaluation after every step beside the generating thread, with a 20 s hang timeout: each thread's guarded
    calls have their own watchdog slot, and the healthy run ends (one shared slot once let a returned call's slot
    stand and ended a run with 75)."""
    run = tmp_path / "run"
    out = _train(model, run, "rollout.overlap=async", "rollout.staleness_limit=1", "train.eval_every=1",
                 "engine.hang_timeout_s=20", "train.save_every=0")
    assert "megarl watchdog" not in out
    steps = _steps(run)
    assert len(steps) == STEPS and all("eval/pass_at_1" in r for r in read_metrics(run / "metrics.jsonl")[1:])


@pytest.mark.slow
def test_the_hang_timer_of_an_evaluation_or_a_save_leaves_out_the_wait_for_the_phase_in_flight(model, tmp_path):
    """async with a verifier of 3 s a call: each phase runs longer than engine.hang_timeout_s (8 s), every engine
    step well within it, and phases run back to back. The evaluation after every step and the checkpoints wait for
    the phase in flight first (its engine steps are guarded on their own) and only then start their hang timer: the
    healthy run completes (it ended with exit 75 when the timers counted the wait)."""
    from helpers.scripts import TESTS

    run = tmp_path / "run"
    out = _train(model, run, "rollout.overlap=async", "train.eval_every=1", "engine.hang_timeout_s=8",
                 "reward.fn=helpers.reward_fns:slow_match", "reward.timeout_s=30", "data.eval_size=1",
                 "train.save_every=2", env={"PYTHONPATH": str(TESTS), "SLOW_REWARD_S": "3"})
    assert "megarl watchdog" not in out
    phase_s = max(float(x) for x in re.findall(r"timing/gen_s ([0-9.]+)", out))
    assert phase_s > 8, phase_s  # (a phase did outlast the timeout: the test's premise)
    assert len(_steps(run)) == STEPS


@pytest.mark.slow
def test_a_resume_under_another_overlap_mode_requeues_what_was_generated_ahead(model, tmp_path):
    """A one_step run killed in step 3 left the batch generated ahead in its step-2 checkpoint; resumed with
    rollout.overlap=none, which cannot take it, its prompts are re-queued (said), none is lost or trained twice."""
    run = tmp_path / "run"
    _train(model, run, "rollout.overlap=one_step", "rollout.staleness_limit=2",
           env={"MEGARL_TEST_KILL": "optimizer_step@3"}, rc=-signal.SIGKILL)
    saved = final_state(run)
    ahead = len(pickle.loads(saved["pipeline"]["queue"]))
    out = _train(model, run, "rollout.overlap=none", "rollout.staleness_limit=2")
    assert ahead and f"{ahead} batches the checkpoint generated ahead" in out and "their prompts are re-queued" in out
    no_prompt_lost_or_twice(final_state(run))
    assert [r["step"] for r in _steps(run)][-1] == STEPS
