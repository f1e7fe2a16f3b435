"""The fault-injection hooks the tests arm: environment variables, read once per process; nothing happens
when they are unset. Product code calls them at named hook points only (``injected``, ``kill_point``, ...).

- ``MEGARL_TEST_KILL=POINT@STEP[:N]`` — SIGKILL this process at the N-th (default 1st) time the
  named point is reached during RL step STEP (1-based). Points: ``engine_step`` (generation),
  ``optimizer_step`` (inside ``train_step``, before the optimizer), ``checkpoint_write`` (after the
  model files of a run checkpoint, before its manifest).
- ``MEGARL_TEST_SLOW_STOP=SECONDS`` — a checkpoint saved after this process received a preemption signal sleeps
  SECONDS at ``checkpoint_write`` (its model files written, its manifest not yet): a checkpoint that takes longer
  than Slurm's GraceTime, so that the SIGKILL lands mid-save (``tests/cluster/test_slurm.py``).
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
  (``kill_checkpoint_writer``): the save must start a new one (``compat.megatron.drop_dead_checkpoint_writer``).
  ``checkpoint_writer_dies_mid_save@STEP``: killed after that check, so that the save itself fails: the run must
  stop with exit 75 (``keeper.SaveFailed``; the requeued job resumes from the last complete checkpoint).
- ``MEGARL_TEST_FAULT=forward_error_last_rank@STEP[:N]`` — the vLLM model's forward raises at its N-th (default
  1st) call during RL step STEP on the last rank only (``arm_forward_fault``, installed when the engine starts):
  at colocated engine TP > 1 its peers block in the TP all-reduce of their own forward, which no agreement
  around the step can reach (``tests/distributed/test_watchdog.py``).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import time

from megarl.compat.megatron import checkpoint_writer_process
from megarl.distributed.collectives import rank_and_world
from megarl.distributed.signals import signalled

log = logging.getLogger(__name__)

_step = 0  # the RL step being run (1-based), for the test hooks
_seen: collections.Counter = collections.Counter()


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
    log.info(f"rank {rank_and_world()[0]}: engine hang injected by MEGARL_TEST_FAULT "
             "(a test hook)")
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
                    log.info(f"rank {rank_and_world()[0]}: forward error injected by "
                             f"MEGARL_TEST_FAULT at call {nth} of RL step {step} (a test hook)")
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
    if point == "checkpoint_write" and delay and signalled():
        log.info(f"rank {rank_and_world()[0]}: checkpoint after {signalled()} slowed by {delay} s "
                 "(MEGARL_TEST_SLOW_STOP, a test hook)")
        time.sleep(float(delay))


def kill_replica(engine, k: int) -> None:
    """SIGKILL disaggregated replica ``k`` and wait for it to be gone (rank 0 drives the replicas; a colocated
    engine has none: nothing happens)."""
    clients = getattr(engine, "clients", None) or []
    if k < len(clients):
        log.info(f"engine replica {k} killed by MEGARL_TEST_FAULT (a test hook)")
        clients[k].proc.kill()
        clients[k].proc.join(30)


def kill_checkpoint_writer() -> None:
    """SIGKILL megatron's checkpoint-writer Manager process of this process, if one runs (a test hook)."""
    process = checkpoint_writer_process()
    if process is not None and process.is_alive():
        log.info(f"rank {rank_and_world()[0]}: checkpoint writer helper (pid {process.pid}) killed by "
                 "MEGARL_TEST_FAULT (a test hook)")
        process.kill()
        process.join(10)


def injected(kind: str, nth: int = 1) -> bool:
    """True (once) when ``MEGARL_TEST_FAULT`` asks for this fault in this step (a test hook)."""
    for name, step, _ in _parse("MEGARL_TEST_FAULT"):
        if name == kind and step == _step:
            _seen[(kind, step)] += 1
            return _seen[(kind, step)] == nth
    return False
