"""Faults a run survives: preemption signals, non-finite steps, engine errors; and the test hooks that cause them.

- **Preemption**: SIGTERM and SIGUSR1 (what Slurm sends before it kills or requeues a job) set a
  flag; the loop checks it at the next safe point (between steps, every rank agreeing through one
  all-reduce), saves a run checkpoint and exits 0. Slurm signals *every* process of the job step, so the
  processes a trainer starts must not die of it (megatron's checkpoint writer keeps a spawned Manager process
  from the first save on; a dead one fails the preemption's save): the main thread blocks both signals, which
  every process it starts afterwards inherits (blocked, they never arrive there), and a thread of ours takes
  them with ``sigwait`` (the Python handlers stay for a signal delivered to another thread).
- **Non-finite steps**: ``PolicyTrainer.train_step`` skips the optimizer step when the loss or a
  gradient is not finite (weights and Adam state untouched); ``BadSteps`` counts them and stops the
  run after ``train.max_bad_steps`` in a row, naming the step and what was non-finite.
- **Engine errors**: see ``megarl/checkpoint/keeper.py`` (and ``agree`` in ``megarl/engines/vllm_engine.py`` at engine
  TP > 1).

Test hooks (environment variables, read once per process; nothing happens when they are unset):

- ``MEGARL_TEST_KILL=POINT@STEP[:N]`` — SIGKILL this process at the N-th (default 1st) time the
  named point is reached during RL step STEP (1-based). Points: ``engine_step`` (generation),
  ``optimizer_step`` (inside ``train_step``, before the optimizer), ``checkpoint_write`` (after the
  model files of a run checkpoint, before its manifest).
- ``MEGARL_TEST_SLOW_STOP=SECONDS`` — a checkpoint saved after this process received a preemption signal sleeps
  SECONDS at ``checkpoint_write`` (its model files written, its manifest not yet): a checkpoint that takes longer
  than Slurm's GraceTime, so that the SIGKILL lands mid-save (``tests/test_slurm.py``).
- ``MEGARL_TEST_FAULT=KIND@STEP[,KIND@STEP...]`` — inject ``nan_grad`` (a NaN in the policy's first
  gradient), ``engine_error`` (the engine raises on its 3rd step), ``engine_error_one_rank`` (the same on rank 0
  only: at engine TP > 1 its peers must not wait for it inside vLLM's collectives), ``engine_unrecoverable``
  (under torchrun, the in-place recovery after an engine error fails: the run stops with a checkpoint) or
  ``sync_error`` (the weight sync's stream breaks half-way) during RL step STEP, or ``engine_hang`` (the engine's 3rd
  step blocks forever on the last rank — rank 0 in one process — while its peers wait for it at the step's
  agreement: the hang watchdog, ``engine.hang_timeout_s``, must end the run with exit 75), or ``engine_stall``
  (from the engine's 3rd step of RL step STEP every step schedules nothing until the engine is reset: the
  controller's no-progress guard must raise ``EngineStalled``, contained by the keeper).
- ``MEGARL_TEST_FAULT=replica_dies_before_audit@STEP`` — disaggregated replicas: replica 0 is SIGKILLed right
  before the ``sync.check_every`` audit of the sync that ends RL step STEP (``kill_replica``): the audit's
  generation fails and ``RunKeeper.sync`` must restart the replicas, sync again and run the audit again.
- ``MEGARL_TEST_FAULT=checkpoint_writer_dies@STEP`` — the helper process megatron's checkpoint writer keeps (a
  multiprocessing Manager, from the first save on) is SIGKILLed before the save after RL step STEP
  (``kill_checkpoint_writer``): the save must start a new one (``keeper.revive_checkpoint_writer``).
  ``checkpoint_writer_dies_mid_save@STEP``: killed after that check, so that the save itself fails: the run must
  stop with exit 75 (``keeper.SaveFailed``; the requeued job resumes from the last complete checkpoint).
- ``MEGARL_TEST_FAULT=forward_error_last_rank@STEP[:N]`` — the vLLM model's forward raises at its N-th (default
  1st) call during RL step STEP on the last rank only (``arm_forward_fault``, installed when the engine starts):
  at colocated engine TP > 1 its peers block in the TP all-reduce of their own forward, which no agreement
  around the step can reach (``tests/test_watchdog.py``).
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from megarl.engines.cluster import any_rank, rank_and_world

_step = 0  # the RL step being run (1-based), for the test hooks
_seen: collections.Counter = collections.Counter()
_signalled = ""  # the preemption signal this process received ('' none), for MEGARL_TEST_SLOW_STOP


def set_step(step: int) -> None:
    """Tell the hooks which RL step (1-based) is running."""
    global _step
    _step = step


def current_step() -> int:
    """The RL step (1-based) the hooks think is running (0 before the first)."""
    return _step


def on_last_rank() -> bool:
    """This process is the last rank (or the only process): where the one-rank fault hooks strike."""
    rank, world = rank_and_world()
    return rank == world - 1


def hang_forever() -> None:
    """The ``engine_hang`` test hook: block like a wedged collective (sleeping, so the watchdog thread runs)."""
    print(f"rank {rank_and_world()[0]}: engine hang injected by MEGARL_TEST_FAULT "
          "(a test hook)", flush=True)
    while True:
        time.sleep(3600)


def arm_forward_fault(model) -> None:
    """The ``forward_error_last_rank`` test hook: wrap ``model.forward`` (vLLM's model, after load) on the last
    rank so that it raises at the N-th call of the named RL step; nothing when the hook is not asked for."""
    wanted = [(step, nth) for name, step, nth in _parse("MEGARL_TEST_FAULT") if name == "forward_error_last_rank"]
    if not wanted or not on_last_rank():
        return
    inner, calls = model.forward, collections.Counter()

    def forward(*args, **kwargs):
        for step, nth in wanted:
            if step == _step:
                calls[step] += 1
                if calls[step] == nth:
                    print(f"rank {rank_and_world()[0]}: forward error injected by "
                          f"MEGARL_TEST_FAULT at call {nth} of RL step {step} (a test hook)", flush=True)
                    raise RuntimeError("forward fault injected by MEGARL_TEST_FAULT (a test hook)")
        return inner(*args, **kwargs)

    model.forward = forward


def _parse(var: str) -> list[tuple[str, int, int]]:
    out = []
    for part in filter(None, os.environ.get(var, "").split(",")):
        point, _, rest = part.partition("@")
        step, _, nth = rest.partition(":")
        out.append((point, int(step), int(nth or 1)))
    return out


def kill_point(point: str) -> None:
    """SIGKILL this process here when ``MEGARL_TEST_KILL`` names this point and step (a test hook)."""
    for name, step, nth in _parse("MEGARL_TEST_KILL"):
        if name == point and step == _step:
            _seen[(point, step)] += 1
            if _seen[(point, step)] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
    delay = os.environ.get("MEGARL_TEST_SLOW_STOP")
    if point == "checkpoint_write" and delay and _signalled:
        print(f"rank {rank_and_world()[0]}: checkpoint after {_signalled} slowed by {delay} s "
              "(MEGARL_TEST_SLOW_STOP, a test hook)", flush=True)
        time.sleep(float(delay))


def kill_replica(engine, k: int) -> None:
    """SIGKILL disaggregated replica ``k`` and wait for it to be gone (rank 0 drives the replicas; a colocated
    engine has none: nothing happens)."""
    clients = getattr(engine, "clients", None) or []
    if k < len(clients):
        print(f"engine replica {k} killed by MEGARL_TEST_FAULT (a test hook)", flush=True)
        clients[k].proc.kill()
        clients[k].proc.join(30)


def kill_checkpoint_writer() -> None:
    """SIGKILL megatron's checkpoint-writer Manager process of this process, if one runs (a test hook)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    process = getattr(getattr(filesystem_async._results_queue, "_manager", None), "_process", None)
    if process is not None and process.is_alive():
        print(f"rank {rank_and_world()[0]}: checkpoint writer helper (pid {process.pid}) killed by "
              "MEGARL_TEST_FAULT (a test hook)", flush=True)
        process.kill()
        process.join(10)


def injected(kind: str, nth: int = 1) -> bool:
    """True (once) when ``MEGARL_TEST_FAULT`` asks for this fault in this step (a test hook)."""
    for name, step, _ in _parse("MEGARL_TEST_FAULT"):
        if name == kind and step == _step:
            _seen[(kind, step)] += 1
            return _seen[(kind, step)] == nth
    return False


def signalled() -> str:
    """The preemption signal this process received ('' none): for waits that must not outlast one."""
    return _signalled


class Preemption:
    """SIGTERM / SIGUSR1 → ``requested``; ``due()`` is the same answer on every rank."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    _waiter: threading.Thread | None = None  # one per process: takes the signals the main thread blocks
    _current: Preemption | None = None  # the instance the waiter reports to (the latest installed)

    def __init__(self) -> None:
        self.received: str = ""
        self.install()

    def install(self) -> None:
        """(Re)install the handlers (after anything that may have set its own, e.g. an engine restart)."""
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)
        if threading.current_thread() is threading.main_thread():
            # multiprocessing's resource tracker, at its first start, unblocks SIGTERM in the thread that started
            # it: started first, so that the block below holds for every process this thread starts later
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
            signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)  # inherited by what this thread starts
            if Preemption._waiter is None:
                Preemption._waiter = threading.Thread(target=Preemption._wait, daemon=True, name="megarl-preemption")
                Preemption._waiter.start()
        Preemption._current = self

    @staticmethod
    def _wait() -> None:
        while True:
            signum = signal.sigwait(Preemption.SIGNALS)
            Preemption._current._handle(signum, None)

    def _handle(self, signum, frame) -> None:
        global _signalled
        self.received = _signalled = signal.Signals(signum).name

    def due(self) -> bool:
        """Whether any rank got a signal (an all-reduce: call it on every rank at the same point)."""
        return any_rank(bool(self.received))


def nonfinite(loss_sums: list, grad_buffers: list[torch.Tensor]) -> str:
    """'' when the loss and every gradient are finite on every rank, else 'loss', 'gradient' or both.

    Each rank holds a part of the model (TP/PP/EP) and the loss lives on the last stage: the
    verdict is all-reduced so that every rank skips the same step.
    """
    loss_bad = any(not torch.isfinite(torch.as_tensor(x)).all() for x in loss_sums)
    grad_bad = any(not torch.isfinite(g).all() for g in grad_buffers)
    flags = torch.tensor([float(loss_bad), float(grad_bad)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return " and ".join(name for name, bad in zip(("loss", "gradient"), flags.tolist()) if bad)


class BadSteps:
    """Counts RL steps whose optimizer step was skipped for a non-finite loss or gradient."""

    def __init__(self, limit: int) -> None:
        self.limit, self.in_a_row, self.total = limit, 0, 0

    def update(self, step: int, learners) -> str:
        """After RL step ``step``: the reason to stop the run ('' to go on)."""
        what = [f"{name} {t.last_nonfinite}" for name, t in learners if t is not None and t.last_nonfinite]
        if not what:
            self.in_a_row = 0
            return ""
        self.in_a_row += 1
        self.total += 1
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"step {step}: non-finite {', '.join(what)}; optimizer step skipped, weights unchanged "
                  f"({self.in_a_row} in a row)", flush=True)
        if self.limit and self.in_a_row >= self.limit:
            return (f"step {step}: {self.in_a_row} steps in a row with a non-finite {', '.join(what)} "
                    f"(train.max_bad_steps={self.limit}); stopping")
        return ""

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row, self.total = state["in_a_row"], state["total"]
