"""slurm/train.sbatch's decision after the job step: requeue on preemption always, on an engine fault (megarl
train's exit status 75, EXIT_REQUEUE) at most MAX_FAULT_REQUEUES times, otherwise exit with the run's status.
The script's own functions, sourced by bash; the real requeue on a two-node Slurm is in tests/cluster/test_slurm.py."""

import os
import subprocess
import sys
import time

import pytest

from helpers.scripts import ROOT
from megarl.keeper import EXIT_REQUEUE


def sbatch_functions(calls: str) -> list[str]:
    script = f'source "{ROOT / "slurm" / "train.sbatch"}"\n{calls}'
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_the_script_and_megarl_agree_on_the_requeue_status():
    text = (ROOT / "slurm" / "train.sbatch").read_text()
    assert f"EXIT_REQUEUE={EXIT_REQUEUE}" in text
    assert EXIT_REQUEUE not in (0, 1, 2, 126, 127) and EXIT_REQUEUE < 128  # not an error, usage, shell or signal


@pytest.mark.parametrize("status,stop,requeued,limit,expected", [
    (0, 1, 0, 3, "requeue"),  # preempted (SIGUSR1): always, whatever the fault count
    (0, 1, 9, 3, "requeue"),
    (EXIT_REQUEUE, 0, 0, 3, "requeue"),  # an engine fault: requeued while under the bound
    (EXIT_REQUEUE, 0, 2, 3, "requeue"),
    (EXIT_REQUEUE, 0, 3, 3, "exit"),  # the bound reached: the job fails with 75
    (EXIT_REQUEUE, 0, 0, 0, "exit"),  # MAX_FAULT_REQUEUES=0: never
    (0, 0, 0, 3, "exit"),  # completed
    (1, 0, 0, 3, "exit"),  # any other failure (non-finite steps, a crash): not requeued
    (137, 0, 0, 3, "exit"),
])
def test_next_action(status, stop, requeued, limit, expected):
    assert sbatch_functions(f"next_action {status} {stop} {requeued} {limit}") == [expected]


def test_run_status_takes_megarls_status_over_torchruns(tmp_path):
    written = tmp_path / "job.0.exit"
    written.write_text(f"{EXIT_REQUEUE}\n")
    garbage = tmp_path / "garbage.exit"
    garbage.write_text("75; rm -rf /\n")
    out = sbatch_functions(f"run_status 1 {written}; run_status 0 {written}; run_status 1 {tmp_path / 'none'}; "
                           f"run_status 137 {garbage}")
    # torchrun's 1 → megarl's 75; a clean srun stays 0; no file: srun's; only a number is believed
    assert out == [str(EXIT_REQUEUE), "0", "1", "137"]


def test_megarl_train_status_and_exit_file(tmp_path, monkeypatch):
    from megarl.cli import _exit_status

    path = tmp_path / "logs" / "7.0.exit"
    monkeypatch.setenv("MEGARL_EXIT_FILE", str(path))
    monkeypatch.setenv("RANK", "0")
    assert _exit_status(requeue=True, error=True) == EXIT_REQUEUE  # an engine fault stopped it with a checkpoint
    assert path.read_text() == f"{EXIT_REQUEUE}\n"
    assert _exit_status(requeue=False, error=True) == 1  # non-finite steps in a row: not requeued
    assert _exit_status(requeue=False, error=False) == 0  # preempted: the checkpoint is saved
    assert path.read_text() == "0\n"
    monkeypatch.setenv("RANK", "1")  # only rank 0 writes
    os.remove(path)
    assert _exit_status(requeue=True, error=True) == EXIT_REQUEUE and not path.exists()


@pytest.mark.slow
def test_megarl_train_exits_75_when_the_engine_keeps_failing(tmp_path):
    """One process, engine.max_restarts=0: the injected engine error in step 1 stops the run with a checkpoint."""
    exit_file = tmp_path / "logs" / "1.0.exit"
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/demo.yaml", "warmup.steps=0",
           "train.steps=2", "train.time_limit_s=0", f"train.run_dir={tmp_path / 'run'}",
           f"model.path={tmp_path / 'model'}",
           "data.eval_size=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
           "engine.slots=4", "engine.kv_cache_gib=0.0625", "engine.max_restarts=0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "MEGARL_TEST_FAULT": "engine_error@1",
                               "MEGARL_EXIT_FILE": str(exit_file)})
    assert proc.returncode == EXIT_REQUEUE, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "engine failed 1 times in a row (engine.max_restarts=0)" in proc.stderr
    assert exit_file.read_text() == f"{EXIT_REQUEUE}\n"
    assert (tmp_path / "run" / "checkpoints" / "step_000000").is_dir()


PREEMPTED_TRAINER = """
import multiprocessing as mp, os, signal, subprocess, sys, time
if __name__ == "__main__":  # (multiprocessing's spawn re-imports this file: no torch there)
    from megarl.distributed.signals import Preemption
    p = Preemption()
    writer = mp.get_context("spawn").Manager()  # what megatron's checkpoint writer starts at the first save
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    time.sleep(1.0)
    for pid in (child.pid, writer._process.pid):
        os.kill(pid, signal.SIGTERM)  # what Slurm does to every process of the job step
    os.kill(os.getpid(), signal.SIGUSR1)  # blocked in the main thread: the waiter thread takes them
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(600):  # (a loaded machine may take seconds to run the waiter thread)
        if p.seen == {"SIGTERM", "SIGUSR1"}:
            break
        time.sleep(0.05)
    time.sleep(0.5)
    print(",".join(sorted(p.seen)), child.poll(), writer._process.is_alive())
    child.kill()
"""


def test_the_preemption_signals_reach_the_trainer_and_not_the_processes_it_starts(tmp_path):
    """Slurm's preemption SIGTERM goes to every process of the step: a trainer's children (megatron's checkpoint
    writer Manager, reward workers) must survive it, and the trainer still sees every signal (megarl/distributed/
    signals.py Preemption: blocked in the main thread, inherited blocked by children, taken by a sigwait thread)."""
    script = tmp_path / "trainer.py"  # a file: multiprocessing's spawn re-imports the main module
    script.write_text(PREEMPTED_TRAINER)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["SIGTERM,SIGUSR1", "None", "True"]  # the trainer got both; its children run


def test_reward_workers_live_through_the_preemption_signals():
    """The reward workers get Slurm's SIGTERM too (every process of the step): they block it and score on."""
    import signal

    from megarl.rewards.pool import RewardPool

    pool = RewardPool("exact", workers=2)
    try:
        for w in pool._workers:
            w.proc.send_signal(signal.SIGTERM)
            w.proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        assert all(w.alive() for w in pool._workers)
        assert pool.score([("3", "3"), ("4", "5")]) == [1.0, 0.0] and pool.errors == 0
    finally:
        pool.close()


def test_the_batch_script_names_rank_0s_node_log(tmp_path):
    """torchrun's c10d rendezvous put rank 0 on srun task 1 (as seen on the two-node test Slurm after a requeue):
    the file with rank 0's lines is node1's, whatever node0's holds."""
    (tmp_path / "7.1.node0.log").write_text("[default0]:[rank1]:W1201 warnings of rank 1\n")
    (tmp_path / "7.1.node1.log").write_text("[default0]:megarl: 2 processes started by torchrun, rendezvous a:1\n"
                                            "[default0]:step 1/40 | reward/mean 0\n")
    (tmp_path / "7.0.node0.log").write_text("[default0]:step 1/40 | reward/mean 0\n")  # started, then no banner
    found = sbatch_functions(f'rank0_log "{tmp_path}" 7 1; rank0_log "{tmp_path}" 7 0; rank0_log "{tmp_path}" 7 2')
    assert found[:2] == [str(tmp_path / "7.1.node1.log"), str(tmp_path / "7.0.node0.log")]
    assert found[2:4] == ["none", "of"]  # restart 2 wrote no log: said so, not an empty path


def test_replica_nodes_beyond_the_allocation_stop_the_batch_script_before_srun(tmp_path):
    """The job's node count (SLURM_NNODES) is known to the batch script: a config error there, one line, exit 2."""
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "SLURM_NNODES": "2", "SLURM_JOB_ID": "4",
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(["bash", "slurm/train.sbatch", "--config", "configs/tiny_cpu.yaml",
                           f"train.run_dir={tmp_path / 'run'}", "engine.placement=disaggregated", "engine.replicas=4",
                           "engine.replica_nodes=4"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == ["megarl: config error: engine.replica_nodes=4: the job has 2 node(s); valid: "
                                        "[0, 1, 2] (0: rank 0's node; N: the job's last N nodes, dividing "
                                        "engine.replicas=4), or ask for more nodes"]
    assert not (tmp_path / "run").exists()  # nothing started, no log directory made
    # dedicated engine-only nodes that leave no trainer node: the same query refuses it (the script has no twin check)
    proc = subprocess.run(["bash", "slurm/train.sbatch", "--config", "configs/tiny_cpu.yaml",
                           f"train.run_dir={tmp_path / 'run'}", "engine.placement=disaggregated", "engine.replicas=2",
                           "engine.replica_nodes=2", "engine.replica_nodes_dedicated=true"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert proc.returncode == 2 and "--nodes 2 leaves no trainer node" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_train_checks_stop_the_batch_script_before_srun(tmp_path):
    """What megarl train refuses before it starts — a model.path with no config.json, a dataset that is not there —
    the batch script refuses before srun: one config error in the batch log, exit 2 (every node failed with exit 1
    after the allocation started, the batch log saying rank 0 did not start)."""
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "SLURM_NNODES": "2", "SLURM_JOB_ID": "5",
           "SLURM_NTASKS": "2", "PATH": "/usr/bin:/bin"}

    def batch(script, *overrides):
        return subprocess.run(["bash", script, "--config", "configs/tiny_cpu.yaml",
                               f"train.run_dir={tmp_path / 'run'}", *overrides],
                              capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)

    for script in ("slurm/train.sbatch", "slurm/mpi.sbatch"):
        proc = batch(script, f"model.path={tmp_path / 'nowhere'}", "model.make_tiny=")
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == (f"megarl: config error: model.path: {tmp_path / 'nowhere'} "
                                                        "holds no config.json "
                                                        "(set model.make_tiny to create a tiny model)")
        proc = batch(script, f"data.path={tmp_path / 'missing.jsonl'}")
        assert proc.returncode == 2 and str(tmp_path / "missing.jsonl") in proc.stderr, proc.stderr
        assert not (tmp_path / "run").exists()  # nothing started, no log directory made


def test_the_container_options_reach_the_job_steps_and_the_scripts_own_checks():
    """CONTAINER_IMAGE / CONTAINER_MOUNTS (pyxis): the srun options of every job step; the script's own checks run
    as a one-task step in the image (a fake srun shows the command it was given); none without an image."""
    fake = 'srun() { echo "srun $*"; }\nCONTAINER=()\n'
    assert sbatch_functions("container_args") == []
    assert sbatch_functions(f"{fake}in_image echo here") == ["here"]  # without an image: run here, no srun
    with_image = ("CONTAINER_IMAGE=nvcr.io#nvidia/pytorch:25.01-py3 CONTAINER_MOUNTS=/models:/models\n"
                  'mapfile -t CONTAINER < <(container_args)\nsrun() { echo "srun $*"; }\n')
    assert sbatch_functions(f"{with_image}printf '%s\\n' \"${{CONTAINER[@]}}\"") == [
        "--container-image=nvcr.io#nvidia/pytorch:25.01-py3", "--container-mounts=/models:/models"]
    assert sbatch_functions(f"{with_image}in_image python3 -m megarl.launch run-dir x") == [
        "srun", "--nodes", "1", "--ntasks", "1", "--relative", "0",
        "--container-image=nvcr.io#nvidia/pytorch:25.01-py3", "--container-mounts=/models:/models",
        "python3", "-m", "megarl.launch", "run-dir", "x"]
