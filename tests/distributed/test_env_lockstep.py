"""Multi-turn episodes under two trainer processes in lockstep (colocated): rank 0 runs the environments, every rank
takes its answers at the same point of the phase, so the ranks' controllers make the same schedule and trajectories
although the answers reach them at different engine steps. Real parts: torch.distributed over gloo (2 processes),
the environment pool on rank 0 (``env_lockstep_checks.py``)."""

from helpers.scripts import run_script


def test_two_lockstep_ranks_run_the_same_episodes_on_rank_0s_answers():
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    "tests/workers/env_lockstep_checks.py"], env={"OMP_NUM_THREADS": "1"}, timeout=300)
    first, second = r["ranks"]
    assert first["runs"] and not second["runs"]  # rank 1 started no environment worker
    assert sorted(first["released"]) == list(range(len(r["rows"])))
    for key in ("submitted", "released", "trajectories", "turns", "calls"):
        assert first[key] == second[key], key  # the same schedule, the same tokens (rank 0's workers' pids too)
    for row, turns in zip((r["rows"][i] for i in first["released"]), first["turns"]):
        assert turns == [row["turns"]] * 2  # every episode whole
    assert not any(first["errors"])
