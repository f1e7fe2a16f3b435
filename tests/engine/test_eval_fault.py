"""A disaggregated engine replica that dies during the held-out evaluation is an engine error the keeper
contains, as it does mid-phase: the replicas are restarted in fresh processes and re-synced, the evaluation runs
again (its result as if nothing happened), counted in ``faults/engine_restarts`` and logged; with no restarts
left the evaluation is skipped (NaN, ``faults/evals_skipped``) and the next phase stops the run with a checkpoint.
Real replica processes, SIGKILLed (tests/workers/eval_fault_checks.py); slow: two replica restarts
(~1 min each here)."""

import pytest

from helpers.scripts import run_script


@pytest.mark.slow
def test_a_replica_killed_during_evaluation_is_restarted_and_the_evaluation_retried(tmp_path):
    r = run_script(["tests/workers/eval_fault_checks.py", str(tmp_path)], env={"OMP_NUM_THREADS": "1"}, timeout=900)
    assert r["recovered"] == r["clean"] and r["same_tokens"]  # re-synced replicas answer as before the kill
    assert not set(r["pids"]) & set(r["pids_before"]) and r["alive"] == [True, True]  # fresh processes
    assert r["versions"] == [0, 0]  # the trainer's weights (version 0) were synced into them
    assert r["faults"]["faults/engine_restarts"] == 1.0 and r["faults"]["faults/evals_skipped"] == 0.0
    assert "evaluation at step 0: engine error" in r["log"][0] and "exit code -9" in r["log"][0]
    assert "restart 1/1" in r["log"][0]
    # engine.max_restarts=0: the second kill is not restarted; the evaluation is skipped, not a crash
    assert r["skipped_is_nan"] and r["evals_skipped"] == 1
    assert any("skipped (faults/evals_skipped 1)" in line for line in r["log"])
    assert r["stop"].startswith("engine failed 2 times in a row")  # the next phase meets the dead replica: StopRun
