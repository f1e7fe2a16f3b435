"""megatron's async checkpoint writer keeps one multiprocessing Manager process from its first save on; when that
helper dies (the OOM killer), the next save must start a new one instead of failing with ``BrokenPipeError``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers.scripts import ROOT
from megarl.compat.megatron import drop_dead_checkpoint_writer


def test_a_dead_checkpoint_writer_helper_is_replaced_before_the_next_save():
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    saved = fa._results_queue
    fa._results_queue = None
    try:
        queue = fa._get_write_results_queue()  # what megatron's writer uses (spawns the Manager)
        queue.put("before")
        assert queue.get() == "before" and drop_dead_checkpoint_writer() == ""  # alive: left alone
        helper = queue._manager._process
        helper.kill()
        helper.join(10)
        try:  # the failure a dead writer caused at the next save
            queue.put("dead")
            raise AssertionError("a dead Manager's queue accepted a put")
        except (BrokenPipeError, EOFError, ConnectionError):
            pass
        why = drop_dead_checkpoint_writer()
        assert f"pid {helper.pid}" in why and "a new one is started" in why
        fresh = fa._get_write_results_queue()
        assert fresh is not queue
        fresh.put("after")
        assert fresh.get() == "after"
        fresh._manager._process.kill()  # ours: end it
        fresh._manager._process.join(10)
    finally:
        fa._results_queue = saved


@pytest.mark.slow
def test_megarl_train_saves_after_its_checkpoint_writer_helper_was_killed(tmp_path):
    """A real run (``configs/tiny_cpu.yaml``, a save every step) whose writer helper is SIGKILLed before the save
    of step 2 (a test hook): the save starts a new helper, the run finishes (exit 0) with every checkpoint."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/tiny_cpu.yaml", "train.steps=3",
           "train.save_every=1", f"train.run_dir={run}", f"model.path={tmp_path / 'model'}"]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "MEGARL_TEST_FAULT": "checkpoint_writer_dies@2"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "checkpoint writer helper" in proc.stdout and "killed by MEGARL_TEST_FAULT" in proc.stdout
    assert "checkpoint save of step 2: megatron's checkpoint writer helper" in proc.stderr  # (a warning)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert (run / "checkpoints" / "step_000002").is_dir()


@pytest.mark.slow
def test_a_save_whose_writer_helper_dies_mid_save_exits_75_and_the_rerun_resumes(tmp_path):
    """The helper dies after the pre-save check (a test hook), so the save of step 2 itself fails: exit 75
    (requeue), not 1; the rerun of the same command resumes from step 1's checkpoint and completes."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/tiny_cpu.yaml", "train.steps=3",
           "train.save_every=1", f"train.run_dir={run}", f"model.path={tmp_path / 'model'}"]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "MEGARL_TEST_FAULT": "checkpoint_writer_dies_mid_save@2",
           "MEGARL_EXIT_FILE": str(tmp_path / "exit")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 75, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "checkpoint save of step 2 failed: a helper process" in proc.stderr
    assert (tmp_path / "exit").read_text().strip() == "75"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000001"
    env.pop("MEGARL_TEST_FAULT")
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-4000:]
    assert "resumed from" in again.stdout and "at step 1" in again.stdout
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000003"
