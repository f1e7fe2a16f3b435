"""An engine error mid-phase under torchrun (2 processes): the colocated vLLM engine is recovered in place
(``VLLMEngine.restart`` at world > 1) and the run goes on, at engine TP 1 (two replicas) and engine TP 2 (one
engine over both ranks); when the recovery fails, the run saves a checkpoint and stops, never hangs. The
subprocess timeout fails the test on a hang."""

from __future__ import annotations

import pytest

from helpers.scripts import run_script


def run(tmp_path, engine_tp: int, fault: str) -> dict:
    return run_script(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                       "tests/workers/restart_checks.py", str(tmp_path), f"engine.tensor_parallel_size={engine_tp}"],
                      env={"OMP_NUM_THREADS": "1", "MEGARL_TEST_FAULT": fault}, timeout=600)


def check_recovered(r: dict, tmp_path) -> None:
    for x in r["ranks"]:
        assert x["error"] == "" and x["stopped"] == "", x
        assert x["restarts"] == 1 and x["steps"] == 2 and x["saved_at"] == 2, x  # both steps done after the fault
        assert max(x["gaps"]) < 1e-3, x  # the recovered engine serves the trainer's weights
    assert (tmp_path / "checkpoints" / "step_000002").is_dir()


def test_engine_error_at_engine_tp1_two_replicas_recovers(tmp_path):
    check_recovered(run(tmp_path, 1, "engine_error@1"), tmp_path)


@pytest.mark.slow
def test_engine_error_at_engine_tp_world_recovers(tmp_path):
    check_recovered(run(tmp_path, 2, "engine_error@1"), tmp_path)


@pytest.mark.slow
def test_an_error_on_one_rank_of_a_tp2_engine_is_every_ranks_and_recovers(tmp_path):
    """Rank 0 alone raises before vLLM's step (whose TP all-reduce on CPU spins without a timeout: its peer would
    wait there forever); the engine's ranks agree before entering vLLM's collectives, both recover."""
    check_recovered(run(tmp_path, 2, "engine_error_one_rank@1"), tmp_path)


@pytest.mark.slow
def test_unrecoverable_engine_saves_a_checkpoint_and_stops(tmp_path):
    r = run(tmp_path, 1, "engine_error@1,engine_unrecoverable@1")
    for x in r["ranks"]:
        assert x["error"] == "" and x["steps"] == 0 and x["saved_at"] == 0, x
        assert "could not be recovered in place" in x["stopped"] and "rerun the same command" in x["stopped"], x
        assert "rank 0: RuntimeError: recovery fault injected" in x["stopped"], x
    assert (tmp_path / "checkpoints" / "step_000000").is_dir()
