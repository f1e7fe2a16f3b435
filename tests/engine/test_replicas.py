"""Disaggregated engines: two vLLM CPU replicas in processes of their own, one trainer, one controller.

Weights go through vLLM's weight-transfer API with our gloo backend (``megarl_gloo``), each
bucket broadcast once to both replicas. In partial mode over several RL steps: every token
event carries the version of the replica that sampled it, and that version is the one the
controller tags the phase with; no prompt is lost; each replica's logprobs equal the trainer's
after a sync; a sync broken after half of its buckets leaves both replicas on their old weights.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.scripts import ROOT, run_script


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    run = tmp_path_factory.mktemp("replicas")
    return run_script(["tests/workers/replica_checks.py", str(run), "warmup.steps=2", "train.steps=3"],
                      env={"OMP_NUM_THREADS": "1"})


def test_every_token_carries_the_version_of_the_replica_that_sampled_it(result):
    events = result["events"]
    assert {k for _, k, _, _ in events} == {0, 1}  # both replicas generated, from one shared queue
    for step, replica, _, version in events:
        assert version == step, (step, replica, version)  # = the controller's tag for that phase
    assert result["versions"] == [1.0, 2.0, 3.0]


def test_no_prompt_lost_in_partial_mode(result):
    drawn = set(result["drawn"])
    assert drawn == set(result["released"]) | set(result["live"]) | set(result["requeued"])
    assert len(result["released"]) >= 3 * 4  # prompts_per_step groups released every step


def test_replicas_match_the_trainer_after_each_sync(result):
    assert all(g <= 1e-4 for g in result["gaps"])  # the audit, on every step
    assert result["gap_stale"] > 1e-2  # before the last sync the trainer had moved on
    assert max(result["gap_each_replica"]) <= 1e-4 and result["replica_versions"] == [4, 4]
    assert result["after_local"]["engine/version"] == 5.0 and result["gap_after_local"] <= 1e-4
    assert result["ok"]["sync/sent_bytes"] == result["ok"]["sync/bytes"]  # each bucket sent once, for both


def test_interrupted_transfer_leaves_every_replica_on_its_old_weights(result):
    assert result["unchanged_after_failure"]  # same greedy tokens, logprobs equal exactly, on both replicas
    assert result["failed"]["engine/version"] == result["version_before"] == 3
    assert "replicas serve versions [3, 3]" in result["log"][0]


def test_a_failure_inside_the_replicas_restores_them_and_keeps_the_group_in_step(result):
    assert "replica 0:" in result["local_error"] and "replica 1:" in result["local_error"]
    assert "replicas serve versions [4, 4]" in result["local_error"]
    assert result["unchanged_after_local_failure"]


def test_resync_rollback_reaches_the_replicas_and_a_failed_load_serves_nothing_until_resynced(result):
    """sync.rollback=resync: the replicas take no backup; a failure inside them leaves both refusing to
    generate (never a mix served), and the next full sync brings both back to the trainer's weights."""
    assert "sync.rollback=resync took no backup" in result["resync_error"]
    assert "must be re-synced" in result["resync_error"] or "until it is re-synced" in result["resync_error"]
    assert result["resync_unusable_versions"] == [-1, -1]
    assert len(result["resync_refused"]) == 3 and all("refuses to generate" in r for r in result["resync_refused"])
    assert result["resync_repaired"]["sync/backup_mib"] == 0.0  # no backup copy on the replicas
    assert result["resync_versions"] == [result["after_local"]["engine/version"] + 1] * 2
    assert result["resync_gap"] <= 1e-4


@pytest.mark.slow
def test_megarl_train_disaggregated_two_replicas_end_to_end(tmp_path):
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/demo.yaml", "warmup.steps=2",
           "train.steps=2", "train.time_limit_s=0", f"train.run_dir={tmp_path / 'run'}",
           f"model.path={tmp_path / 'model'}", "data.eval_size=4", "rollout.prompts_per_step=4",
           "rollout.samples_per_prompt=4", "engine.slots=8", "engine.kv_cache_gib=0.0625",
           "engine.placement=disaggregated", "engine.replicas=2", "rollout.mode=partial"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step 2/2 |" in proc.stdout and "eval after RL: pass@1" in proc.stdout


@pytest.mark.slow
def test_restart_gives_the_controller_handles_new_processes(tmp_path):
    """After an engine error the keeper restarts the engines: same handles, fresh processes, same outputs."""
    from megarl.engines.remote.replicas import EngineReplicas
    from megarl.models.tiny import TinyShape, make_tiny_model
    from megarl.types import GenerationRequest

    model = make_tiny_model(tmp_path / "model", TinyShape(family="qwen2"), seed=0)
    replicas = EngineReplicas(str(model), 2, 1, 64, 0.0625, 4)
    try:
        handles = list(replicas.clients)
        pids = [c.proc.pid for c in handles]
        probe = [GenerationRequest([3, 5, 7, 11], n=1, max_tokens=6, greedy=True)]
        before = [replicas.generate(probe, seed=0, replica=k)[0][0].token_ids for k in range(2)]
        replicas.restart()
        assert replicas.clients == handles and all(c.proc.pid not in pids for c in handles)
        assert not any(pid_alive(p) for p in pids)
        after = [replicas.generate(probe, seed=0, replica=k)[0][0].token_ids for k in range(2)]
        assert before == after
    finally:
        replicas.close()
    assert not any(c.proc.is_alive() for c in handles)


def pid_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _train_with_audit_kill(tmp_path, *overrides: str):
    """``megarl train`` (2 replicas, ``sync.check_every=1``, 3 steps) with replica 0 SIGKILLed right before the audit
    of step 2's sync (a test hook): (the process, metrics.jsonl's rows by step, the processes it left)."""
    import json
    import os

    run, tag = tmp_path / "run", f"audit-kill-{os.getpid()}-{tmp_path.name}"
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/demo.yaml", "train.steps=3",
           "warmup.steps=2", "train.time_limit_s=0", f"train.run_dir={run}", f"model.path={tmp_path / 'model'}",
           "data.eval_size=0", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2",
           "rollout.max_new_tokens=16", "engine.slots=8", "engine.kv_cache_gib=0.0625",
           "engine.placement=disaggregated", "engine.replicas=2", "sync.check_every=1", *overrides]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "MEGARL_TEST_FAULT": "replica_dies_before_audit@2",
           "MEGARL_TEST_TAG": tag}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "step" in r}
    return proc, rows, _tagged_processes(tag)


@pytest.mark.slow
def test_megarl_train_survives_a_replica_killed_just_before_the_sync_audit(tmp_path):
    """The keeper counts the death, restarts the replicas, syncs again and runs the audit again; the run finishes
    (exit 0), and no process of the run is left."""
    proc, rows, left = _train_with_audit_kill(tmp_path, "engine.max_restarts=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    out = proc.stdout + proc.stderr  # (faults are warnings: stderr)
    assert "engine replica 0 killed by MEGARL_TEST_FAULT" in out
    assert "weight sync to version 2: engine error (" in out and "the sync and its audit run again; restart 1/2" in out
    assert "step 3/3 |" in out
    assert rows[1]["faults/engine_restarts"] == 0 and rows[2]["faults/engine_restarts"] == 1
    assert rows[3]["faults/engine_restarts"] == 1
    for step in (1, 2, 3):  # the audit ran after every sync, the interrupted one again after the restart
        assert rows[step]["sync/logprob_gap"] <= 1e-4, rows[step]
    assert rows[3]["engine/version"] == 3
    assert not left


@pytest.mark.slow
def test_megarl_train_stops_with_a_checkpoint_when_the_audit_fails_past_max_restarts(tmp_path):
    """``engine.max_restarts=0``: the death before the audit stops the run with a checkpoint of step 2 (its update
    done) and exit 75 (requeue), like every engine fault past the limit."""
    from megarl.keeper import EXIT_REQUEUE

    proc, rows, left = _train_with_audit_kill(tmp_path, "engine.max_restarts=0")
    assert proc.returncode == EXIT_REQUEUE, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "step 2: engine failed 1 times in a row (engine.max_restarts=0)" in proc.stdout
    assert "checkpoint saved, stopping" in proc.stdout and "Traceback" not in proc.stderr
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert not left


def _tagged_processes(tag: str) -> list[int]:
    """The pids of live processes whose environment holds ``MEGARL_TEST_TAG=tag`` (a run's leftovers)."""
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"MEGARL_TEST_TAG={tag}".encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found
