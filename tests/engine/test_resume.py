"""Run checkpoints, exact resume after kill -9, preemption and contained faults — real runs of ``megarl train``.

A tiny dense model, partial rollout (so the buffer holds unfinished samples at every checkpoint),
6 RL steps, a checkpoint every 2. One uninterrupted run is the reference; each other run is killed
(the process SIGKILLs itself at a named point: ``MEGARL_TEST_KILL``) or signalled, resumed with the
same command, and must write the same ``metrics.jsonl`` (wall-clock scalars aside) and end with the
same rollout controller state.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import time

import pytest

from helpers.runs import final_state, no_prompt_lost_or_twice, reap, start, tiny_partial_run
from helpers.runs import train as run_train
from helpers.scripts import ROOT
from megarl.checkpoint.run import RunCheckpoints, verify
from megarl.checkpoint.session_state import buffer_digest
from megarl.logging.metrics import deterministic_view, final_pass_at_1, read_metrics

STEPS = 6


def _args(model, run_dir, *extra):
    return tiny_partial_run(model, run_dir, STEPS, "optim.lr_decay=cosine", "algo.entropy_coef=0.01", *extra)


def _start(model, run_dir, *extra, env=None, out=None):
    return start(_args(model, run_dir, *extra), env=env, out=out)


def train(model, run_dir, *extra, env=None, rc=0):
    return run_train(_args(model, run_dir, *extra), run_dir, env=env, rc=rc)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    from megarl.models.tiny import TinyShape, make_tiny_model

    work = tmp_path_factory.mktemp("resume")
    model = make_tiny_model(work / "model", TinyShape(family="qwen2"), seed=3)
    run = work / "baseline"
    out = train(model, run)
    assert f"step {STEPS}/{STEPS} |" in out
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6, 6] and records[-1]["final"]
    assert any(r.get("loss/grad_norm", 0) > 0 for r in records), "the reference run must move its weights"
    assert (RunCheckpoints(run).steps()[:2] == [6, 4]
            and (run / "checkpoints" / "latest").read_text().strip() == "step_000006")
    state = final_state(run)
    assert state["controller"]["live"], "partial mode: unfinished samples are in the buffer at the checkpoint"
    no_prompt_lost_or_twice(state)
    return model, run, records, state


def _resumed_from(out):
    m = re.search(r"resumed from \S+step_(\d+) at step \d+: (\d+) groups in the rollout buffer \(digest (\w+)\)", out)
    assert m, out[-3000:]
    return int(m.group(1)), m.group(3)


def _check_same_as_baseline(baseline, run):
    _, _, records, state = baseline
    got = read_metrics(run / "metrics.jsonl")
    assert [deterministic_view(r) for r in got] == [deterministic_view(r) for r in records]
    resumed = final_state(run)
    wall = ("clock", "slot_time", "token_s")  # the controller's engine time is measured with the wall clock
    assert {k: v for k, v in resumed["controller"].items() if k not in wall} == {
        k: v for k, v in state["controller"].items() if k not in wall}
    assert resumed["source"] == state["source"] and resumed["stateful"] == state["stateful"]
    no_prompt_lost_or_twice(resumed)


# (kill point, RL step, occurrence, last metrics line written, checkpoint the resumed run starts from)
KILLS = [
    ("engine_step", 3, 3, 2, 2),  # during generation of step 3
    pytest.param("checkpoint_write", 4, 1, 4, 2, marks=pytest.mark.slow),  # step 4's checkpoint half-written
    pytest.param("optimizer_step", 5, 1, 4, 4, marks=pytest.mark.slow),  # inside step 5's optimizer step
]


@pytest.mark.parametrize("point,step,nth,last_line,resume_step", KILLS, ids=lambda v: str(v))
def test_kill_9_then_resume_is_exact(baseline, tmp_path, point, step, nth, last_line, resume_step):
    model = baseline[0]
    run = tmp_path / "run"
    train(model, run, env={"MEGARL_TEST_KILL": f"{point}@{step}:{nth}"}, rc=-signal.SIGKILL)
    assert read_metrics(run / "metrics.jsonl")[-1]["step"] == last_line
    if point == "checkpoint_write":
        assert (run / "checkpoints" / "step_000004.tmp").is_dir()
    saved = pickle.loads((run / "checkpoints" / f"step_{resume_step:06d}" / "state.pkl").read_bytes())
    out = train(model, run)
    assert _resumed_from(out) == (resume_step, buffer_digest(saved["controller"]))  # the buffer as saved
    assert not list((run / "checkpoints").glob("*.tmp"))
    _check_same_as_baseline(baseline, run)


@pytest.mark.slow  # 35 s; a signal's save stays in the default run: test_overlap's SIGTERM on the default path
def test_sigusr1_saves_exits_0_and_the_next_start_resumes(baseline, tmp_path):
    model = baseline[0]
    run = tmp_path / "run"
    proc = _start(model, run, out=subprocess.PIPE)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 1/"):
                proc.send_signal(signal.SIGUSR1)
                t0 = time.time()
        assert proc.wait(timeout=300) == 0, "".join(lines)[-4000:]
    finally:
        reap(proc)
    out = "".join(lines)
    assert time.time() - t0 < 120
    m = re.search(r"step (\d+): SIGUSR1 received; checkpoint saved, stopping", out)
    assert m, out[-3000:]
    stopped_at = int(m.group(1))
    assert 1 <= stopped_at < STEPS and "eval after RL" not in out
    assert RunCheckpoints(run).steps()[0] == stopped_at
    out = train(model, run)
    assert _resumed_from(out)[0] == stopped_at
    _check_same_as_baseline(baseline, run)



@pytest.mark.slow  # (two runs after the baseline's: 80 s)
def test_sigterm_during_the_warmup_saves_its_steps_and_the_rerun_is_exact(baseline, tmp_path):
    """SIGTERM at the end of warm-up step 7 of 20 (``MEGARL_TEST_SIGTERM``; the run's process signals itself and
    waits for its handler, so the step is fixed): the warm-up stops there, the run saves step 0 holding the 7 steps
    done (weights, Adam state, the task's cursor, RNG) and exits 0 before any evaluation or RL step. The same command
    goes on with warm-up step 8: the NLL of every warm-up step, ``metrics.jsonl`` (wall clock aside), the rollout
    buffer and the prompt accounting are the uninterrupted run's. (Nothing of the exactness is given up: the
    conversation stream of ``warmup.path`` is derived again from its seed, ``tests/unit/test_warmup_stop.py``.)"""
    model, _, _, state = baseline
    run = tmp_path / "run"
    out = train(model, run, env={"MEGARL_TEST_SIGTERM": "warmup_step@7"})
    assert "warmup step 7/20: SIGTERM received; checkpoint saved, stopping" in out, out[-3000:]
    assert "warmup 10/20" not in out and "eval before RL" not in out and "step 1/" not in out
    saved = final_state(run)
    assert saved["step"] == 0 and saved["run"]["warmup_done"] == 7
    assert saved["run"]["warmup_nll"] == state["run"]["warmup_nll"][:7]
    assert not read_metrics(run / "metrics.jsonl")  # nothing logged before RL's first evaluation
    out = train(model, run)
    assert re.search(r"resumed from \S+step_000000 at step 0:", out), out[-3000:]
    assert "warmup 10/20" in out and "warmup 20/20" in out
    resumed = final_state(run)
    assert resumed["run"]["warmup_done"] == 20 and resumed["run"]["warmup_nll"] == state["run"]["warmup_nll"]
    _check_same_as_baseline(baseline, run)


@pytest.mark.slow
def test_sigterm_to_every_process_while_the_session_starts_is_kept_and_stops_the_run_at_its_first_phase(tmp_path):
    """Slurm's preemption can land while the session is still being built (minutes for a large model): SIGTERM to
    every process of the run (its process group, as Slurm signals a job step) while vLLM loads the model. The
    handlers ``train.run`` installs before the session keep it (before: the default action ended the run, nothing
    saved); the first phase stops at its first engine step (no warm-up here: a warm-up stops after its first step,
    ``test_sigterm_during_the_warmup_saves_its_steps_and_the_rerun_is_exact``), the run saves step 0 and exits 0, and
    what the session started survived to end cleanly."""
    run = tmp_path / "run"
    proc = _start(tmp_path / "model", run, "warmup.steps=0", out=subprocess.PIPE)
    lines, sent = [], False
    try:
        for line in proc.stdout:
            lines.append(line)
            if not sent and "Loading safetensors checkpoint shards" in line:
                os.killpg(proc.pid, signal.SIGTERM)
                sent = True
        assert proc.wait(timeout=300) == 0, "".join(lines)[-4000:]
    finally:
        reap(proc)
    out = "".join(lines)
    assert sent and "step 0: SIGTERM received; checkpoint saved, stopping" in out, out[-3000:]
    assert RunCheckpoints(run).steps()[0] == 0 and "step 1/" not in out and "eval after RL" not in out

@pytest.mark.slow  # (a whole session started to train nothing: 11 s)
def test_a_finished_run_resubmitted_says_it_has_nothing_to_train(baseline, tmp_path):
    """A requeued or resubmitted job whose run is done: it says so and changes nothing (no step, no re-export)."""
    model, run, records, _ = baseline
    again = tmp_path / "again"
    shutil.copytree(run, again)
    exported = {p: p.stat().st_mtime_ns for p in (again / "hf").rglob("*") if p.is_file()}
    out = train(model, again)
    assert f"nothing to train: the run in {again} finished at step {STEPS} (train.steps={STEPS};" in out, out[-3000:]
    after = final_pass_at_1(run / "metrics.jsonl")  # (its own final evaluation: the demo's "after" on a rerun)
    assert not math.isnan(after) and f"its pass@1 after RL was {after:.3f}" in out
    assert f"step {STEPS + 1}" not in out and "eval after RL" not in out
    assert exported and {p: p.stat().st_mtime_ns for p in (again / "hf").rglob("*") if p.is_file()} == exported
    assert [deterministic_view(r) for r in read_metrics(again / "metrics.jsonl")] == \
        [deterministic_view(r) for r in records]


def test_truncated_newest_checkpoint_falls_back_to_the_previous(baseline, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(baseline[1], run)
    ckpts = RunCheckpoints(run)
    newest = ckpts.root / "step_000006"
    shard = next((newest / "policy").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])
    assert "truncated" in verify(newest)
    with pytest.warns(UserWarning, match=r"step_000006 is unusable: .*distcp has \d+ bytes, the manifest says"):
        assert ckpts.latest() == ckpts.root / "step_000004"
    (ckpts.root / "step_000004" / "manifest.json").unlink()
    with pytest.warns(UserWarning, match="manifest.json is missing"):
        assert ckpts.latest() is None


def _tensors(ckpt_dir, tmp_path):
    """Every tensor of a dist checkpoint (model weights and Adam's moments), read without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{ckpt_dir.parent.name}.pt"
    dcp_to_torch_save(ckpt_dir, out)
    return torch.load(out, weights_only=False)


def test_nan_gradient_skips_the_step_and_engine_fault_is_requeued(baseline, tmp_path):
    """Engine raises in step 2's generation → phase re-run on a restarted engine; NaN gradients in steps 3
    and 4 → both optimizer steps skipped (weights and Adam state bitwise those of step 2), and with
    train.max_bad_steps=2 the run stops after step 4 with a checkpoint and exit status 1."""
    model = baseline[0]
    run = tmp_path / "run"
    out = train(model, run, "train.save_every=1", "train.keep_checkpoints=10", "train.max_bad_steps=2",
                env={"MEGARL_TEST_FAULT": "sync_error@1,engine_error@2,nan_grad@3,nan_grad@4"}, rc=1)
    assert re.search(r"step 2: engine error mid-phase \(RuntimeError: engine fault injected.*\); \d+ live groups "
                     r"restored, \d+ new prompts re-queued; restart 1/3", out), out[-3000:]
    assert "step 3: non-finite policy gradient; optimizer step skipped" in out
    assert "step 4: 2 steps in a row with a non-finite policy gradient (train.max_bad_steps=2); stopping" in out
    records = {r["step"]: r for r in read_metrics(run / "metrics.jsonl")}
    assert [records[s]["faults/engine_restarts"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert [records[s]["faults/nonfinite_steps"] for s in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert records[2]["loss/grad_norm"] > 0 and records[3]["loss/grad_norm"] != records[3]["loss/grad_norm"]  # NaN
    root = run / "checkpoints"
    assert RunCheckpoints(run).steps() == [4, 3, 2, 1]
    assert records[1]["sync/failures"] == 1.0  # (step 1's sync failed; the engine kept serving the old weights)
    # ... and rollout.overlap=none generates with the newest weights only (staleness 0, whatever staleness_limit
    # says): step 2's phase waits for the sync to run again rather than sample with version 0's weights
    assert ("step 2: the engines serve version 0, behind version 1 (rollout.overlap=none: 0 versions at most): "
            "the weight sync runs again") in out, out[-3000:]
    w1, w2, w4 = (_tensors(root / f"step_{s:06d}" / "policy", tmp_path) for s in (1, 2, 4))
    assert w2.keys() == w4.keys() and any("exp_avg" in k for k in w2)
    assert all(w2[k].equal(w4[k]) for k in w2 if hasattr(w2[k], "equal")), "a skipped step changed the weights"
    assert not all(w1[k].equal(w2[k]) for k in w1 if hasattr(w1[k], "equal")), "step 2 trained normally"
    no_prompt_lost_or_twice(final_state(run))
    train(model, run, "train.save_every=1", "train.keep_checkpoints=10", "train.steps=5")  # resumed at step 4
    records = {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if not r.get("final")}
    assert records[5]["sync/failures"] == 1.0 and records[5]["faults/engine_restarts"] == 1.0  # counted on (was 0)


@pytest.mark.slow
def test_resume_at_another_layout(baseline, tmp_path):
    """Saved by 2 processes (trainer DP=2 with the distributed optimizer, one engine with TP=2 across them),
    resumed by 1: the dist checkpoint reshards, the controller state is layout-free."""
    model = baseline[0]
    run = tmp_path / "run"
    train(model, run, "--nproc", "2", "engine.tensor_parallel_size=2", "train.steps=2")
    saved = final_state(run)
    assert saved["step"] == 2 and len(list((run / "checkpoints" / "step_000002" / "rng").iterdir())) == 2
    out = train(model, run, "train.steps=4")
    assert _resumed_from(out) == (2, buffer_digest(saved["controller"]))
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [0, 1, 2, 3, 4, 4]
    no_prompt_lost_or_twice(final_state(run))


@pytest.mark.parametrize("override,message", [
    ("train.keep_checkpoints=0", "train.keep_checkpoints must be >= 1"),
    ("train.resume=/no/such/checkpoint", "train.resume='/no/such/checkpoint': expected 'auto', 'never' or an existing"),
    ("engine.max_restarts=-1", "engine.max_restarts must be >= 0"),
])
def test_bad_checkpoint_settings_are_config_errors(override, message):
    from megarl.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_config(ROOT / "configs" / "demo.yaml", [override]), 1)


def test_deterministic_refuses_a_wall_clock_limit():
    from megarl.config import ConfigError, load_config, validate

    cfg = load_config(ROOT / "configs" / "demo.yaml", ["train.deterministic=true"])  # the demo has time_limit_s: 600
    with pytest.raises(ConfigError, match="train.deterministic=true needs train.time_limit_s=0"):
        validate(cfg, 1)


@pytest.mark.parametrize("curriculum", [False, True], ids=["pool", "curriculum"])
def test_prompt_stream_continues_exactly_after_restore(curriculum):
    """The data state of a checkpoint (prompts drawn, task cursor, pass-rate tracker, curriculum RNG):
    a fresh source restored from it draws what the original draws next."""
    from types import SimpleNamespace

    from megarl.algo.curriculum import CurriculumSource, PassRateTracker
    from megarl.checkpoint.session_state import IndexedSource, apply, capture
    from megarl.data.addition import AdditionTask
    from megarl.data.source import AdditionSource
    from megarl.models.tiny import build_tokenizer
    from megarl.rollout.pipeline import Pipeline
    from megarl.rollout.scoring import PromptFeed, pool_prompt_source

    tokenizer = build_tokenizer()

    def session(pool_size):
        task = AdditionTask(4, 1.0, seed=1, eval_size=5)
        stateful, source = {}, PromptFeed(AdditionSource(task, tokenizer))
        if pool_size:
            pool, tracker = task.next_problems(pool_size), PassRateTracker()
            draw = CurriculumSource(pool, lambda p: p.prompt, tracker, seed=1) if curriculum else None
            source = pool_prompt_source(pool, tokenizer, 1, draw)
            stateful = {"tracker": tracker, **({"curriculum": draw} if draw else {})}
        pipeline = Pipeline("none", None, 1)  # (nothing generated ahead)
        controller = SimpleNamespace(next_prompt=IndexedSource(source), snapshot=lambda: pickle.dumps({}),
                                     load_state_dict=lambda _: None, lock=pipeline.lock)
        optimizer = SimpleNamespace(param_groups=[{"lr": 0.0}])
        return SimpleNamespace(task=task, rewards=None, controller=controller, stateful=stateful,
                               trainer=SimpleNamespace(optimizer=optimizer), policy_version=0, pipeline=pipeline)

    for pool_size in (0, 12):
        a = session(pool_size)
        for i in range(7):
            item = a.controller.next_prompt()
            if pool_size:
                a.stateful["tracker"].update(item.prompt_text, [float(i % 2)] * 4)
        a.policy_version = 2  # 3 steps, one without an update (no useful group)
        state = pickle.loads(pickle.dumps(capture(a, 3, {})))
        b = session(pool_size)
        apply(b, state)
        assert b.policy_version == 2  # what the engines serve after resume, and staleness is counted against
        want = [(x.index, x.prompt_text) for x in (a.controller.next_prompt() for _ in range(6))]
        got = [(x.index, x.prompt_text) for x in (b.controller.next_prompt() for _ in range(6))]
        assert got == want and want[0][0] == 7


@pytest.mark.slow
def test_engine_failing_past_max_restarts_stops_with_a_checkpoint(baseline, tmp_path):
    model = baseline[0]
    run = tmp_path / "run"
    # an engine fault is the job's to retry: keeper.EXIT_REQUEUE (75), which slurm/train.sbatch requeues (this slow
    # test still expected 1, from before engine faults were requeued)
    out = train(model, run, "engine.max_restarts=0", env={"MEGARL_TEST_FAULT": "engine_error@2"}, rc=75)
    assert ("step 1: engine failed 1 times in a row (engine.max_restarts=0); "
            "last: RuntimeError: engine fault injected") in out
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000001"
    state = final_state(run)
    assert state["step"] == 1 and state["controller"]["live"]  # the buffer as it was before the failed phase
    no_prompt_lost_or_twice(state)
    out = train(model, run)  # the same command resumes and finishes
    assert _resumed_from(out)[0] == 1 and f"step {STEPS}/{STEPS} |" in out


@pytest.mark.slow  # (two runs, 80 s: the default run keeps test_nan_gradient_skips_..., an engine error contained)
def test_a_restart_that_fails_stops_the_run_with_a_checkpoint_for_the_requeue(baseline, tmp_path):
    """An engine error in step 3's phase, then the engines' restart itself raises (a replica that does not come back,
    a fresh engine that fails to start): contained as a refused restart is, a checkpoint of step 2 and exit 75
    (requeued by the batch script), not exit 1 with the steps since the last save lost; the same command resumes."""
    model = baseline[0]
    run = tmp_path / "run"
    out = train(model, run, "train.save_every=0", env={"MEGARL_TEST_FAULT": "engine_error@3,engine_restart_fails@3"},
                rc=75)
    assert "the engines did not come back after step 3: engine error mid-phase" in out, out[-3000:]
    assert "RuntimeError: engine restart fault injected" in out
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000002"
    no_prompt_lost_or_twice(final_state(run))
    out = train(model, run)
    assert _resumed_from(out)[0] == 2 and f"step {STEPS}/{STEPS} |" in out


def test_metrics_jsonl_drops_lines_past_the_checkpoint(tmp_path):
    from megarl.logging.metrics import MetricsLogger

    log = MetricsLogger(tmp_path, total_steps=5)
    for step in range(6):
        log.scalars(step, {"loss/policy": step / 10, "timing/gen_s": 1.0})
    log.scalars(5, {"eval/pass_at_1": 0.5}, final=True)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss/po')  # a line cut short by a kill
    log.resume_at(3)
    log.scalars(4, {"loss/policy": 0.7})
    assert [(r["step"], r.get("loss/policy")) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (0, 0.0), (1, 0.1), (2, 0.2), (3, 0.3), (4, 0.7)]
    assert deterministic_view({"step": 1, "timing/gen_s": 2.0, "rollout/bubble_ratio": 0.1, "loss/policy": 1.0}) == {
        "step": 1, "loss/policy": 1.0}
    log.start_fresh()  # train.resume=never in a used run_dir
    assert read_metrics(tmp_path / "metrics.jsonl") == []
    log.close()
