"""Multi-turn episodes under two trainer processes in lockstep (colocated): rank 0 runs the environments, every rank
takes its answers at the same point of the phase, so the ranks' controllers make the same schedule and trajectories
although the answers reach them at different engine steps. Real parts: torch.distributed over gloo (2 processes),
the environment pool on rank 0 (``env_lockstep_checks.py``)."""

import subprocess
import sys

import pytest

from helpers.runs import final_state, no_prompt_lost_or_twice
from helpers.scripts import ROOT, run_script
from megarl.logging.metrics import read_metrics

pytestmark = pytest.mark.alone  # env steps under a 5 s timeout: never beside another test (make test)


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


@pytest.mark.slow  # (a real run of two processes: minutes)
def test_megarl_train_multi_turn_with_two_colocated_ranks(tmp_path):
    """The real command: 2 processes, a vLLM engine per rank, partial mode, a two-turn environment: the run trains,
    second turns are taken, and no prompt is lost or held twice."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/demo.yaml", "--nproc", "2",
           "model.make_tiny=qwen2", f"model.path={tmp_path / 'model'}", f"train.run_dir={run}", "parallel.tp=2",
           "engine.tensor_parallel_size=1", "rollout.mode=partial", "warmup.steps=20", "warmup.batch_size=16",
           "train.steps=2", "train.save_every=2", "train.time_limit_s=0", "data.eval_size=0", "data.max_digits=2",
           "rollout.prompts_per_step=3", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=96",
           "engine.max_model_len=160", "engine.slots=8", "engine.kv_cache_gib=0.25", "optim.micro_batch_size=12",
           "env.fn=helpers.envs:Countdown", "env.workers=1", "env.max_turns=3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "tests")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "loss/policy" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert max(r["rollout/turns_max"] for r in steps) >= 2 and steps[-1]["env/calls"] > 0
    assert max(r["rollout/tool_calls"] for r in steps) > 0
    no_prompt_lost_or_twice(final_state(run))
