"""The named weight-sync protocol with the real parts: megatron-core (gloo) → a colocated vLLM CPU engine.

A sync whose stream breaks after half of its buckets leaves the engine serving exactly the old
weights (same greedy tokens, logprobs equal bit for bit, version unchanged); a full sync then
runs the stages in order and the audit finds engine ≈ trainer, and a skipped sync is caught. A
model with a tied LM head gets the trainer's logprobs after a protocol sync too. With
``sync.rollback=resync`` a sync takes no backup (peak extra RSS far below ``copy``'s), a broken
stream leaves the engine refusing to generate, and the next full sync repairs it.
"""

from __future__ import annotations

import pytest

from helpers.scripts import run_script
from megarl.models.tiny import TinyShape, make_tiny_model


def run_protocol(tmp_path, family: str) -> dict:
    model = make_tiny_model(tmp_path / family, TinyShape(family=family), seed=3)
    # every buffer of 4 KiB or more its own mapping (the tiny models' tensors are small), so that RSS sees the
    # rollback copy come and go: at 64 KiB glibc's heap reused freed memory and the peaks were noise
    return run_script(["tests/workers/protocol_checks.py", str(model)], env={"OMP_NUM_THREADS": "1",
                                                                    "MALLOC_MMAP_THRESHOLD_": "4096"})


def check(r: dict) -> None:
    assert 0 < r["tensors_fed"] and r["buckets"] > 4  # the stream really broke half-way through
    assert r["failed"]["sync/failures"] == 1.0 and r["failed"]["engine/version"] == 0.0
    assert r["failed_stages"] == ["pause", "stream+load", "resume"]
    assert "engine still serves version 0" in r["log"][0]
    assert r["same_tokens"] and r["logprob_diff_after_failure"] == 0.0  # the old weights, exactly: never a mix
    assert r["ok"]["engine/version"] == 1.0 and r["ok"]["sync/failures"] == 1.0
    assert r["ok_stages"] == ["pause", "stream+load", "reset_prefix_cache", "bump_version", "resume", "audit"]
    assert r["ok"]["sync/logprob_gap"] <= 1e-4 and r["gap_synced"] <= 1e-4
    assert r["gap_skipped"] > 1e-2  # the audit catches an engine that did not get the step's weights
    assert 0 < r["ok"]["sync/backup_mib"] < 64  # the rollback copy: weights only, never the KV cache
    check_resync(r)


def check_resync(r: dict) -> None:
    """sync.rollback=resync: no backup; a failed load → the engine serves nothing; the next sync repairs it."""
    assert r["backup_copy_mib"] > 0 and r["backup_resync_mib"] == 0.0
    # copy mode holds the old weights (copies + vLLM's old packed weights) for the whole load; resync does not
    assert min(r["peaks_copy"]) - max(r["peaks_resync"]) >= 0.5 * r["model_bytes"], r
    assert r["resync_failed"]["engine/version"] == -1.0 and r["resync_failed"]["sync/failures"] == 1.0
    assert "engine unusable until re-synced" in r["resync_log"][0] and "sync.rollback=resync" in r["resync_log"][0]
    assert len(r["refused"]) == 3 and all("refuses to generate" in why and "sync.rollback=resync" in why
                                          for why in r["refused"])  # generate, submit, step: never a mix served
    assert r["resync_repaired"]["engine/version"] == 4.0 and r["resync_repaired"]["sync/backup_mib"] == 0.0
    assert r["resync_gap"] <= 1e-4


def test_interrupted_sync_leaves_old_weights_moe(tmp_path):
    check(run_protocol(tmp_path, "qwen3_moe"))


@pytest.mark.slow
def test_interrupted_sync_leaves_old_weights_dense(tmp_path):
    check(run_protocol(tmp_path, "qwen2"))


def test_loop_syncs_by_protocol_with_audit_and_cpu_sleep_skipped(tmp_path):
    """`megarl train` in partial mode: each step's sync bumps engine/version, the audit finds engine ≈ trainer."""
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from helpers.scripts import ROOT

    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/demo.yaml", "warmup.steps=2",
           "train.steps=2", "train.time_limit_s=0", f"train.run_dir={tmp_path / 'run'}",
           f"model.path={tmp_path / 'model'}", "data.eval_size=8", "rollout.prompts_per_step=4",
           "rollout.samples_per_prompt=4", "engine.slots=32", "engine.kv_cache_gib=0.25", "rollout.mode=partial",
           "sync.check_every=1", "engine.sleep_level=1", "trainer.offload_during_rollout=true"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("engine.sleep_level=1: vLLM has no sleep mode") == 1
    assert proc.stdout.count("trainer.offload_during_rollout: the trainer's state is already in host memory") == 1
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()

    def values(tag):
        return [e.value for e in acc.Scalars(tag)]

    assert values("engine/version") == [1.0, 2.0]
    assert len(values("sync/logprob_gap")) == 2 and max(values("sync/logprob_gap")) <= 1e-4
    assert values("sync/failures") == [0.0, 0.0]


@pytest.mark.slow
def test_a_load_failing_on_one_engine_rank_restores_every_rank(tmp_path):
    """Engine TP=2 across two trainer processes: rank 1's load fails, rank 0's succeeds → both keep the old weights."""
    model = make_tiny_model(tmp_path / "moe", TinyShape(family="qwen3_moe"), seed=3)
    out = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                      "tests/workers/protocol_checks.py", "ranks", str(model)], env={"OMP_NUM_THREADS": "1"})
    for rank, r in enumerate(out["ranks"]):
        assert r["failed"]["sync/failures"] == 1.0 and r["failed"]["engine/version"] == 0.0, rank
        assert r["unchanged"], rank  # the old weights on both ranks, exactly: never a mix across ranks
        assert r["ok"]["engine/version"] == 1.0 and r["gap"] <= 1e-4, rank
    assert "another engine rank failed" in out["ranks"][0]["log"][0]
    assert "injected: rank 1" in out["ranks"][1]["log"][0]
    for r in out["ranks"]:  # sync.rollback=resync: both ranks serve nothing, then the next sync repairs both
        assert r["resync_failed"]["engine/version"] == -1.0 and "sync.rollback=resync" in r["refused"]
        assert r["resync_ok"]["engine/version"] == 2.0 and r["resync_gap"] <= 1e-4


@pytest.mark.slow  # (13 s; the default run keeps test_families' tied Llama 3 synced into vLLM)
def test_protocol_sync_of_a_tied_lm_head_gives_the_trainers_logprobs(tmp_path):
    r = run_script(["tests/workers/protocol_checks.py", "tied", str(tmp_path)], env={"OMP_NUM_THREADS": "1"})
    assert r["tied"] and r["gap_stale"] > 1e-2  # the trainer moved; the engine had not yet
    assert r["metrics"]["engine/version"] == 1.0 and r["gap_after"] <= 1e-4  # was ~0.07 with a stale packed head


def test_sync_rollback_is_checked_before_launch(tmp_path, capsys):
    """A bad sync.rollback is refused by validation and by `megarl plan`, naming the key and the valid values."""
    import json

    from megarl.config import ConfigError, load_config, validate
    from megarl.launch.plan import main as plan_main
    from megarl.models.tiny import hf_config

    assert load_config(None, []).sync.rollback == "copy"  # the default: today's all-or-nothing copy
    validate(load_config(None, ["sync.rollback=resync"]), 1)
    with pytest.raises(ConfigError, match=r"sync.rollback must be one of 'copy', 'resync'; got 'none'"):
        validate(load_config(None, ["sync.rollback=none"]), 1)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(TinyShape(family="qwen2"), eos_id=1, pad_id=0)))
    rc = plan_main(["--model", str(tmp_path / "config.json"), "--nodes", "1", "--gpus-per-node", "2",
                    "sync.rollback=nothing"])
    err = capsys.readouterr().err
    assert rc == 2 and "sync.rollback must be one of 'copy', 'resync'" in err, err


@pytest.mark.slow
def test_a_failed_resync_mode_sync_is_repaired_by_the_keeper_in_a_training_run(tmp_path):
    """`megarl train` with sync.rollback=resync and step 1's sync broken half-way: the engine serves nothing
    (engine/version -1); before step 2's phase the keeper finds it past the staleness bound and runs the whole sync
    again, which repairs it (no phase refused, no restart: the keeper's staleness guard, issue 37), the run ends with
    the engine serving the trainer's weights."""
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from helpers.scripts import ROOT

    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/demo.yaml", "warmup.steps=2",
           "train.steps=3", "train.time_limit_s=0", f"train.run_dir={tmp_path / 'run'}",
           f"model.path={tmp_path / 'model'}", "data.eval_size=8", "rollout.prompts_per_step=4",
           "rollout.samples_per_prompt=4", "engine.slots=32", "engine.kv_cache_gib=0.25", "sync.check_every=1",
           "sync.rollback=resync"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "MEGARL_TEST_FAULT": "sync_error@1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout + proc.stderr  # (faults are warnings: stderr)
    assert "engine unusable until re-synced" in out
    assert "the weight sync runs again" in out and "EngineUnusable" not in out, out[-3000:]
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()

    def values(tag):
        return [e.value for e in acc.Scalars(tag)]

    assert values("engine/version") == [-1.0, 2.0, 3.0]  # step 1's engine served nothing until re-synced
    assert values("sync/backup_mib") == [0.0, 0.0]  # (logged by the successful syncs) no backup copy
    assert values("sync/failures")[-1] == 1.0 and values("faults/engine_restarts")[-1] == 0.0
    assert max(values("sync/logprob_gap")) <= 1e-4  # after the repair the engine serves the trainer's weights
