"""slurm/train.sbatch on a real two-node Slurm (tests/cluster/slurm_cluster.sh: Debian's slurm-wlm and munge as
plain processes on this machine): the tiny config across 2 nodes × 1 task through examples/tiny_cpu.sh,
a job signalled mid-run that checkpoints, requeues itself and resumes where it stopped, and (slow) jobs
preempted by Slurm itself (PreemptMode=REQUEUE) with a GraceTime long enough for a checkpoint, and too short."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from helpers.scripts import ROOT

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("slurmctld", "slurmd", "munged", "sbatch")) or os.geteuid() != 0,
    reason="missing system tool: slurm-wlm and munge (installed by .ci/run), run as root")

DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _cluster(tmp_path_factory, **env):
    cluster = tmp_path_factory.mktemp("slurm")
    script = str(ROOT / "tests" / "cluster" / "slurm_cluster.sh")
    proc = subprocess.run([script, "start", str(cluster)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    try:
        assert proc.returncode == 0, proc.stderr
        yield {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf"), "PYTHON": sys.executable,
               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    finally:
        subprocess.run([script, "stop", str(cluster)], timeout=60)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    yield from _cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def preemptible(tmp_path_factory):
    """Jobs in the default partition `main` are preempted (REQUEUE) by jobs in `high`; each test sets GraceTime."""
    yield from _cluster(tmp_path_factory, SLURM_TEST_PREEMPT="60")


def job_field(env, job: str, field: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, env=env).stdout
    for item in out.split():
        if item.startswith(field + "="):
            return item.split("=", 1)[1]
    return ""


def wait_for(env, job: str, timeout: float, until=None) -> str:
    """Poll the job (squeue/scontrol; `sbatch --wait` polls coarsely) until it ends or ``until()`` holds."""
    end = time.time() + timeout
    while time.time() < end:
        state = job_field(env, job, "JobState")
        if state in DONE or (until is not None and until()):
            return state
        time.sleep(1)
    subprocess.run(["scancel", job], env=env)
    raise AssertionError(f"job {job} still {state} after {timeout} s")


def submit_tiny(env, run_dir, *overrides, nodes: int = 2) -> str:
    proc = subprocess.run(["bash", "examples/tiny_cpu.sh", *overrides], capture_output=True, text=True, cwd=ROOT,
                          env={**env, "NODES": str(nodes), "RUN_DIR": str(run_dir)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "→ fits" in proc.stdout  # the example ran `megarl plan` before submitting
    return proc.stdout.strip().splitlines()[-1]


def logs(run_dir, job: str, restart: int) -> list[str]:
    return [(run_dir / "logs" / f"{job}.{restart}.node{n}.log").read_text() for n in (0, 1)]


def steps_logged(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines()
            if line.strip() and not json.loads(line).get("final")]


def test_two_node_job_of_the_tiny_config_completes_and_writes_metrics(slurm, tmp_path):
    run_dir = tmp_path / "run"
    job = submit_tiny(slurm, run_dir)
    state = wait_for(slurm, job, 600)
    batch = (run_dir / "logs" / f"{job}.batch.log").read_text()
    node0, node1 = logs(run_dir, job, 0)
    assert state == "COMPLETED", batch + node0[-3000:] + node1[-3000:]
    assert job_field(slurm, job, "NodeList") == "n[1-2]" and job_field(slurm, job, "ExitCode") == "0:0"
    both = node0 + node1
    assert "2 processes started by torchrun" in both  # one rank 0, rendezvous across the two nodes
    assert "step 4/4 |" in both and "eval after RL: pass@1" in both
    assert "[default0]:" in node0 and "[default0]:" in node1  # every node's rank wrote its own log
    assert len(list((run_dir / "logs" / f"{job}.0").rglob("stdout.log"))) == 2  # and torchrun's per-rank files
    assert steps_logged(run_dir) == [0, 1, 2, 3, 4]
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))


def test_the_batch_script_sizes_the_trainer_by_trainer_gpus_per_node_not_by_the_nodes_gpus(slurm, tmp_path):
    """TRAINER_GPUS_PER_NODE=1 of GPUS_PER_NODE=2 (the rest for replicas): the pre-srun check sees 1 trainer process
    a node, so TP 2 is refused there (with 2 it would pass), in the batch log, before any srun."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = ["--config", "configs/tiny_cpu.yaml", f"model.path={run_dir}/model", f"train.run_dir={run_dir}",
            "parallel.tp=2", "parallel.sequence_parallel=true"]
    proc = subprocess.run(["sbatch", "--parsable", "-N", "2", "--output", str(run_dir / "batch.log"),
                           "slurm/train.sbatch", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**slurm, "GPUS_PER_NODE": "2", "TRAINER_GPUS_PER_NODE": "1"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    assert wait_for(slurm, job, 120) == "FAILED"
    batch = (run_dir / "batch.log").read_text()
    assert "config error: parallel.tp=2 must divide the GPUs per node (1)" in batch, batch
    assert not list((run_dir / "logs").glob("*.node*.log"))  # refused before srun


@pytest.fixture()
def two_core_nodes(tmp_path_factory):
    yield from _cluster(tmp_path_factory, SLURM_TEST_CPUS="2")


@pytest.mark.slow  # (a cluster of its own, 40 s; the container's srun options stay in test_slurm_requeue.py)
def test_the_sites_sbatch_options_and_a_task_of_the_nodes_cores_reach_the_job(two_core_nodes, tmp_path):
    """MEGARL_SBATCH_ARGS (partition, time, comment ...) after the example's own options, sbatch's SBATCH_* from
    the environment, and --cpus-per-task from the partition's nodes (sinfo: 2 cores each here; Slurm's default is
    1), so that the one task a node runs gets the node's cores; CPUS_PER_TASK overrides it. The jobs are cancelled
    once submitted."""
    slurm = two_core_nodes
    env = {**slurm, "MEGARL_SBATCH_ARGS": "--partition=main --time=30 --comment=megarl-site"}
    job = submit_tiny(env, tmp_path / "run")
    try:
        fields = {f: job_field(slurm, job, f) for f in ("Partition", "TimeLimit", "Comment", "CPUs/Task", "JobName")}
    finally:
        subprocess.run(["scancel", job], env=slurm, timeout=30)
    assert fields == {"Partition": "main", "TimeLimit": "00:30:00", "Comment": "megarl-site", "CPUs/Task": "2",
                      "JobName": "megarl-tiny"}, fields
    job = submit_tiny({**slurm, "CPUS_PER_TASK": "1", "SBATCH_TIMELIMIT": "45"}, tmp_path / "run1")
    try:
        assert (job_field(slurm, job, "CPUs/Task"), job_field(slurm, job, "TimeLimit")) == ("1", "00:45:00")
    finally:
        subprocess.run(["scancel", job], env=slurm, timeout=30)


@pytest.mark.slow  # (~3 min: the default run keeps the two-node job and test_slurm_requeue's requeue logic)
def test_a_signalled_job_checkpoints_requeues_and_continues_the_step_count(slurm, tmp_path):
    run_dir = tmp_path / "run"
    steps = 40  # ~0.3 s each: the signal lands mid-run
    job = submit_tiny(slurm, run_dir, f"train.steps={steps}", "train.save_every=100")
    # Once a step or two is logged, send what Slurm sends before a time limit (--signal=B:USR1@120).
    wait_for(slurm, job, 600, until=lambda: len(steps_logged(run_dir)) >= 3)
    assert job_field(slurm, job, "JobState") == "RUNNING", "the job ended before it could be signalled"
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True)
    wait_for(slurm, job, 120, until=lambda: job_field(slurm, job, "Restarts") == "1")
    state = wait_for(slurm, job, 600)
    batch = (run_dir / "logs" / f"{job}.batch.log").read_text()
    first, second = "".join(logs(run_dir, job, 0)), "".join(logs(run_dir, job, 1))
    assert state == "COMPLETED", batch + second[-4000:]
    assert "SIGUSR1" in batch and f"requeueing job {job}" in batch and "restart 1" in batch
    assert "checkpoint saved, stopping" in first and f"step {steps}/{steps} |" not in first
    stopped_at = int(first.split("checkpoint saved, stopping")[0].rsplit("step ", 1)[1].split(":")[0])
    assert f"at step {stopped_at}" in second and "resumed from" in second  # the requeued job resumed
    assert f"step {steps}/{steps} |" in second and f"step {stopped_at}/{steps} |" not in second  # continued
    assert f"step {stopped_at + 1}/{steps} |" in second
    assert steps_logged(run_dir) == list(range(0, steps + 1))  # one line per step, as if never stopped


@pytest.mark.slow
def test_mpi_sbatch_runs_ranks_started_by_srun_pmix(slurm, tmp_path):
    """slurm/mpi.sbatch: `srun --mpi=pmix` starts two ranks that meet through mpi4py. One node: the two
    slurmd of this machine would share PMIx's /tmp/spmix_appdir_* directory."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    job = subprocess.run(["sbatch", "--parsable", "-N", "1", "-n", "2", "--overcommit", "-o",
                          str(run_dir / "batch.log"), "slurm/mpi.sbatch", "--config", "configs/tiny_cpu.yaml",
                          "train.steps=2", f"train.run_dir={run_dir}", f"model.path={tmp_path / 'model'}"],
                         capture_output=True, text=True, cwd=ROOT, env=slurm, check=True).stdout.strip()
    state = wait_for(slurm, job, 600)
    rank0 = (run_dir / "logs" / f"{job}.0.rank0.log").read_text()
    assert state == "COMPLETED", (run_dir / "batch.log").read_text() + rank0[-3000:]
    assert "megarl: 2 processes started by mpi" in rank0 and "step 2/2 |" in rank0
    assert (run_dir / "logs" / f"{job}.0.rank1.log").is_file()


@pytest.mark.slow
def test_srun_direct_ranks_find_each_other_through_slurm(slurm, tmp_path):
    """No torchrun: `srun` starts one `megarl train` per task; rank, world and the first node's address
    come from Slurm (megarl/distributed/bootstrap.py)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    wrap = (f"srun --kill-on-bad-exit=1 {sys.executable} -m megarl.cli train --config configs/tiny_cpu.yaml "
            f"train.steps=2 train.run_dir={run_dir} model.path={tmp_path / 'model'}")
    job = subprocess.run(["sbatch", "--parsable", "-N", "2", "-o", str(run_dir / "job.log"), "--wrap", wrap],
                         capture_output=True, text=True, cwd=ROOT, env=slurm, check=True).stdout.strip()
    state = wait_for(slurm, job, 600)
    out = (run_dir / "job.log").read_text()
    assert state == "COMPLETED", out[-4000:]
    assert "megarl: 2 processes started by slurm, rendezvous 127.0.0.1:" in out and "step 2/2 |" in out


@pytest.mark.slow
def test_an_engine_fault_stop_requeues_the_job_a_bounded_number_of_times(slurm, tmp_path):
    """The engine's recovery is refused in step 2 (a test hook, every time): megarl train saves a checkpoint and
    exits 75 (torchrun: 1; rank 0 writes 75 to $MEGARL_EXIT_FILE); the script requeues once (MAX_FAULT_REQUEUES=1),
    the requeued job resumes at step 1, meets the same fault, and then the job fails with exit code 75."""
    run_dir = tmp_path / "run"
    env = {**slurm, "MEGARL_TEST_FAULT": "engine_error@2,engine_unrecoverable@2", "MAX_FAULT_REQUEUES": "1"}
    job = submit_tiny(env, run_dir)
    state = wait_for(slurm, job, 900)
    batch = (run_dir / "logs" / f"{job}.batch.log").read_text()
    first, second = "".join(logs(run_dir, job, 0)), "".join(logs(run_dir, job, 1))
    assert state == "FAILED" and job_field(slurm, job, "ExitCode") == "75:0", batch + second[-4000:]
    assert job_field(slurm, job, "Restarts") == "1"
    assert "could not be recovered in place" in first and "step 1: " in first and "checkpoint saved" in first
    # torchrun's report: megarl train exited 75 (on the node that ended first; srun's --kill-on-bad-exit may end
    # the other node's torchrun before it writes its own report) and never with another status
    assert first.count("exitcode  : 75") >= 1 and "exitcode  : 1\n" not in first
    assert f"fault requeue 1/1; requeueing job {job}" in batch
    assert "resumed from" in second and "at step 1" in second  # the requeued job continued from the checkpoint
    assert "after 1 fault requeues (MAX_FAULT_REQUEUES=1): not requeueing" in batch
    assert (run_dir / "logs" / f"{job}.0.exit").read_text() == "75\n"
    assert (run_dir / "logs" / f"{job}.fault_requeues").read_text().strip() == "1"
    assert steps_logged(run_dir) == [0, 1]  # step 2 never completed; nothing logged twice


def preempt(env, tmp_path, job: str, nodes: int = 2) -> str:
    """Submit a short job to the `high` partition on all the nodes: Slurm preempts ``job`` for it."""
    assert job_field(env, job, "JobState") == "RUNNING", "the job ended before it could be preempted"
    return subprocess.run(["sbatch", "--parsable", "-p", "high", "-N", str(nodes), "-o", str(tmp_path / "high.log"),
                           "--wrap", "echo high ran; sleep 2"], capture_output=True, text=True, env=env,
                          check=True).stdout.strip()


def set_grace(env, seconds: int) -> None:
    subprocess.run(["scontrol", "update", "PartitionName=main", f"GraceTime={seconds}"], env=env, check=True)
    assert f"GraceTime={seconds}" in subprocess.run(["scontrol", "show", "partition", "main"], capture_output=True,
                                                    text=True, env=env).stdout


def last_step(log: str) -> int:
    """The last ``step N/M |`` progress line of a log."""
    found = re.findall(r"step (\d+)/\d+ \|", log)
    return int(found[-1]) if found else 0


@pytest.mark.slow
def test_slurm_preemption_with_ample_grace_checkpoints_once_and_slurms_requeue_continues_the_steps(preemptible,
                                                                                                 tmp_path):
    """Slurm preempts the job for a higher-tier one: SIGTERM to every step process (not the batch shell). The
    trainers finish their step, save one checkpoint and exit 0 well within GraceTime (torchrun, the reward
    workers and megatron's checkpoint writer ignore the signal); Slurm would mark a job that ended by itself COMPLETED,
    so the batch script sees the preemption (PreemptTime) and requeues once; the high job runs; the requeued job resumes
    and completes."""
    env, run_dir, steps = preemptible, tmp_path / "run", 40
    set_grace(env, 60)
    job = submit_tiny(env, run_dir, f"train.steps={steps}", "train.save_every=3")
    # after a periodic save: megatron's checkpoint writer then has a process of its own, which must survive too
    wait_for(env, job, 600, until=lambda: len(steps_logged(run_dir)) >= 5)
    high = preempt(env, tmp_path, job)
    wait_for(env, job, 180, until=lambda: job_field(env, job, "Restarts") == "1")
    assert wait_for(env, high, 300) == "COMPLETED" and "high ran" in (tmp_path / "high.log").read_text()
    state = wait_for(env, job, 600)
    batch = (run_dir / "logs" / f"{job}.batch.log").read_text()
    first, second = "".join(logs(run_dir, job, 0)), "".join(logs(run_dir, job, 1))
    assert state == "COMPLETED" and job_field(env, job, "Restarts") == "1", batch + second[-4000:]
    assert f"Slurm preempted job {job} (SIGTERM)" in batch and batch.count(f"requeueing job {job}") == 1
    assert "SIGUSR1" not in batch and "fault" not in batch and not (run_dir / "logs" / f"{job}.fault_requeues").exists()
    # the trainers: one checkpoint at the step they were at, saved on every rank; torchrun never ended them
    assert first.count("SIGTERM received; checkpoint saved, stopping") == 1, first[-4000:]
    stopped_at = last_step(first)
    assert f"step {stopped_at}: SIGTERM received; checkpoint saved, stopping" in first and stopped_at < steps
    assert "death signal" not in first and "Closing process" not in first
    assert (run_dir / "logs" / f"{job}.0.exit").read_text() == "0\n"
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped_at:06d}'} at step {stopped_at}" in second
    assert f"step {stopped_at + 1}/{steps} |" in second and f"step {stopped_at}/{steps} |" not in second
    assert steps_logged(run_dir) == list(range(0, steps + 1))  # one line per step, as if never preempted
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stepped = [r for r in records if "faults/engine_restarts" in r]  # each RL step's record (a renamed metric: none)
    assert [r["step"] for r in stepped] == list(range(1, steps + 1)), [r["step"] for r in stepped]
    assert all(r["reward/errors"] == 0 and r["faults/engine_restarts"] == 0 for r in stepped)


@pytest.mark.slow
def test_slurm_preemption_with_too_short_grace_resumes_from_the_last_complete_periodic_checkpoint(preemptible,
                                                                                                tmp_path):
    """GraceTime 1 s and a checkpoint slowed to 90 s (MEGARL_TEST_SLOW_STOP): Slurm SIGKILLs the job mid-save and
    requeues it itself (the batch script never gets to requeue). The requeued job resumes from the last periodic
    checkpoint (train.save_every=5), not the half-written one; the steps after it run again, and metrics.jsonl
    keeps one line per step (the killed attempt's lines past the checkpoint are dropped on resume, and said so)."""
    env, run_dir, steps = {**preemptible, "MEGARL_TEST_SLOW_STOP": "90"}, tmp_path / "run", 40
    set_grace(env, 1)
    job = submit_tiny(env, run_dir, f"train.steps={steps}", "train.save_every=5")
    wait_for(env, job, 600, until=lambda: len(steps_logged(run_dir)) >= 7)
    high = preempt(env, tmp_path, job)
    wait_for(env, job, 180, until=lambda: job_field(env, job, "Restarts") == "1")
    assert wait_for(env, high, 300) == "COMPLETED"
    state = wait_for(env, job, 600)
    batch = (run_dir / "logs" / f"{job}.batch.log").read_text()
    first, second = "".join(logs(run_dir, job, 0)), "".join(logs(run_dir, job, 1))
    assert state == "COMPLETED" and job_field(env, job, "Restarts") == "1", batch + second[-4000:]
    assert "slowed by 90 s" in first and "checkpoint saved, stopping" not in first  # killed mid-save
    assert "requeueing" not in batch and "restart 1" in batch  # Slurm requeued it, not the script
    ran_to = last_step(first)
    resumed = (ran_to - 1) // 5 * 5  # the last periodic checkpoint before the one being written
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{resumed:06d}'} at step {resumed}" in second, second
    assert f"metrics.jsonl: {ran_to - resumed} lines past step {resumed} dropped" in second
    assert f"step {resumed + 1}/{steps} |" in first and f"step {resumed + 1}/{steps} |" in second  # run again
    assert steps_logged(run_dir) == list(range(0, steps + 1))
    assert not list((run_dir / "checkpoints").glob("*.tmp"))  # the half-written one was cleared by a later save
