"""The fault-injection hooks the tests arm, by environment variables read when a session is built: ``install``
wraps the session's rooms (its engines, trainer, weight sync and checkpoint saver) with the faults asked for, and
does nothing when none is. The product's code paths hold no check of their own.

- ``MEGARL_TEST_KILL=POINT@STEP[:N]`` — SIGKILL this process at the N-th (default 1st) time the named point is
  reached during RL step STEP (1-based). Points: ``engine_step`` (generation), ``optimizer_step`` (after the
  backward, before the optimizer), ``checkpoint_write`` (after the model files of a run checkpoint, before its
  manifest).
- ``MEGARL_TEST_SIGTERM=warmup_step@N`` — this process sends itself SIGTERM (Slurm's preemption) at the end of the
  N-th supervised warm-up step it takes, and waits until its handler took the signal: the run must stop right after
  that step.
- ``MEGARL_TEST_SLOW_STOP=SECONDS`` — a checkpoint saved after this process received a preemption signal sleeps
  SECONDS at ``checkpoint_write``: a checkpoint that takes longer than Slurm's GraceTime, so that the SIGKILL lands
  mid-save (``tests/cluster/test_slurm.py``).
- ``MEGARL_TEST_FAULT=KIND@STEP[,KIND@STEP...]`` — during RL step STEP:
  ``nan_grad`` (a NaN in the policy's first gradient); ``engine_error`` (the engine raises before its 3rd step);
  ``engine_error_one_rank`` (the same on rank 0 only: at engine TP > 1 its peers must not wait for it inside
  vLLM's collectives); ``engine_unrecoverable`` (under torchrun, the in-place recovery after an engine error
  fails: the run stops with a checkpoint); ``engine_restart_fails`` (the engines' restart after an engine error
  raises, as a replica that does not come back or a fresh in-process engine that fails to start: the run stops with
  a checkpoint, exit 75); ``sync_error`` (the weight sync's stream breaks half-way);
  ``engine_hang`` (the engine's 3rd step blocks forever on the last rank — rank 0 in one process — while its
  peers wait for it: the hang watchdog, ``engine.hang_timeout_s``, must end the run with exit 75);
  ``engine_stall`` (from the engine's 3rd step every step schedules nothing until the engine is reset: the
  controller's no-progress guard must raise ``EngineStalled``, contained by the keeper);
  ``replica_load_error`` (disaggregated replicas: the sync's plan reaches replica 1 with one tensor's shape
  transposed, so that replica's load fails and it keeps its old weights while the others load);
  ``replica_dies_before_audit`` (disaggregated replicas: replica 0 is SIGKILLed right before the
  ``sync.check_every`` audit of the sync that ends step STEP: the keeper must restart the replicas, sync again
  and run the audit again); ``checkpoint_writer_dies`` (megatron's checkpoint-writer helper process is SIGKILLed
  before the save after step STEP: the save must start a new one) and ``checkpoint_writer_dies_mid_save`` (killed
  after that check, so the save itself fails: exit 75, ``SaveFailed``); ``forward_error_last_rank[:N]`` (the vLLM
  model's forward raises at its N-th call on the last rank only: at colocated engine TP > 1 its peers block in
  the TP all-reduce of their own forward, which no agreement around the step can reach); ``optimizer_hang`` (the
  policy's optimizer step blocks forever after its backward on the last rank, while its peers wait for it in the
  step's non-finite check, a collective: the watchdog must end the run with exit 75).

Colocated engines only for the engine hooks: a disaggregated replica's process runs no hooks. The RL step is the
one the loop announces to the watchdog (``distributed.watchdog.note_rl_step``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import time

from megarl.compat.megatron import checkpoint_writer_process
from megarl.distributed.collectives import rank_and_world
from megarl.distributed.signals import signalled
from megarl.distributed.watchdog import rl_step
from megarl.engines.colocated import ColocatedEngines
from megarl.engines.remote.messages import Update
from megarl.engines.remote.replicas import EngineReplicas
from megarl.types import StepReport
from megarl.weight_sync.streaming import WeightsOverride

log = logging.getLogger(__name__)

ENGINE_STEP_FAULTS = ("engine_error", "engine_error_one_rank", "engine_hang", "engine_stall")
_seen: collections.Counter = collections.Counter()


def _parse(var: str) -> list[tuple[str, int, int]]:
    out = []
    for part in filter(None, os.environ.get(var, "").split(",")):
        point, _, rest = part.partition("@")
        step, _, nth = rest.partition(":")
        out.append((point, int(step), int(nth or 1)))
    return out


def _asked(*kinds: str) -> bool:
    return any(name in kinds for name, _, _ in _parse("MEGARL_TEST_FAULT"))


def injected(kind: str, nth: int = 1) -> bool:
    """True (once) when ``MEGARL_TEST_FAULT`` asks for this fault in this step, at its ``nth`` reach."""
    for name, step, _ in _parse("MEGARL_TEST_FAULT"):
        if name == kind and step == rl_step():
            _seen[(kind, step)] += 1
            return _seen[(kind, step)] == nth
    return False


def kill_point(point: str) -> None:
    """SIGKILL this process here when ``MEGARL_TEST_KILL`` names this point and step."""
    for name, step, nth in _parse("MEGARL_TEST_KILL"):
        if name == point and step == rl_step():
            _seen[(point, step)] += 1
            if _seen[(point, step)] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
    delay = os.environ.get("MEGARL_TEST_SLOW_STOP")
    if point == "checkpoint_write" and delay and signalled():
        log.info(f"rank {rank_and_world()[0]}: checkpoint after {signalled()} slowed by {delay} s "
                 "(MEGARL_TEST_SLOW_STOP, a test hook)")
        time.sleep(float(delay))


def signal_point(point: str, count: int) -> None:
    """SIGTERM this process at the ``count``-th reach of ``point`` when ``MEGARL_TEST_SIGTERM`` names them; returns
    once the preemption handler took it (its thread, ``distributed/signals.py``), so the next check sees it."""
    if (point, count) not in [(name, step) for name, step, _ in _parse("MEGARL_TEST_SIGTERM")]:
        return
    log.info(f"rank {rank_and_world()[0]}: SIGTERM sent at {point} {count} by MEGARL_TEST_SIGTERM (a test hook)")
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 30
    while not signalled() and time.monotonic() < deadline:
        time.sleep(0.01)


def _killing_at(point: str) -> bool:
    return any(name == point for name, _, _ in _parse("MEGARL_TEST_KILL")) or (
        point == "checkpoint_write" and bool(os.environ.get("MEGARL_TEST_SLOW_STOP")))


def on_last_rank() -> bool:
    rank, world = rank_and_world()
    return rank == world - 1


def hang_forever(where: str = "engine") -> None:
    """Block like a wedged collective (sleeping, so the watchdog thread runs)."""
    log.info(f"rank {rank_and_world()[0]}: {where} hang injected by MEGARL_TEST_FAULT (a test hook)")
    while True:
        time.sleep(3600)


def install(session) -> None:
    """Wrap ``session``'s rooms with the faults the environment asks for (nothing when it asks for none)."""
    if not (_parse("MEGARL_TEST_FAULT") or _parse("MEGARL_TEST_KILL") or _parse("MEGARL_TEST_SIGTERM")
            or os.environ.get("MEGARL_TEST_SLOW_STOP")):
        return
    engines = session.engines
    if isinstance(engines, ColocatedEngines):
        if _asked(*ENGINE_STEP_FAULTS) or _killing_at("engine_step"):
            _faulty_steps(engines.local)
        if _asked("engine_unrecoverable"):
            _failing_recovery(engines.engine)
        if _asked("forward_error_last_rank"):
            _failing_forward(engines.engine.worker.model_runner.get_model())
    if _asked("engine_restart_fails"):
        _failing_restart(engines)
    if _asked("sync_error"):
        _breaking_loads(engines)
    if _asked("replica_dies_before_audit") and isinstance(engines, EngineReplicas):
        _dying_audit(session.weight_sync, engines)
    if _asked("replica_load_error") and isinstance(engines, EngineReplicas) and len(engines.clients) > 1:
        _one_replica_fails(engines.clients[1])
    if _asked("nan_grad", "optimizer_hang") or _killing_at("optimizer_step"):
        faulty_optimizer_steps(session.trainer)
    if _asked("checkpoint_writer_dies", "checkpoint_writer_dies_mid_save") or _killing_at("checkpoint_write"):
        _faulty_saves(session.saver)
    if any(name == "warmup_step" for name, _, _ in _parse("MEGARL_TEST_SIGTERM")):
        _signalled_warmup(session.trainer)


def _faulty_steps(slot) -> None:
    """The engine step hooks inside a ``VLLMSlotEngine``'s guarded step (and around its reset, which ends a stall).
    A fault is a problem of this rank's, agreed over the engine's TP group before the step as a real one would be."""
    step, reset, stalled = slot._step, slot.reset, [False]

    def faulty_step() -> StepReport:
        kill_point("engine_step")
        problem = ""
        if injected("engine_error", nth=3):
            problem = "engine fault injected by MEGARL_TEST_FAULT (a test hook)"
        if injected("engine_error_one_rank", nth=3) and rank_and_world()[0] == 0:
            problem = "engine fault injected on rank 0 only by MEGARL_TEST_FAULT (a test hook)"
        if injected("engine_hang", nth=3) and on_last_rank():
            hang_forever()  # the last rank only: its peers block at the agreement below
        slot._agree(problem, "before vLLM's step")
        stalled[0] = stalled[0] or injected("engine_stall", nth=3)
        if stalled[0]:  # what vLLM did with its slots held by a failed call's requests: nothing scheduled
            return StepReport([], 0.0, slot.num_active())
        return step()

    def reset_stall() -> None:
        stalled[0] = False
        reset()

    slot._step, slot.reset = faulty_step, reset_stall


def _failing_restart(engines) -> None:
    restart = engines.restart

    def failing() -> None:
        if injected("engine_restart_fails"):
            raise RuntimeError("engine restart fault injected by MEGARL_TEST_FAULT (a test hook)")
        restart()

    engines.restart = failing


def _failing_recovery(engine) -> None:
    recover = engine.recover

    def failing() -> None:
        if injected("engine_unrecoverable"):
            raise RuntimeError("recovery fault injected by MEGARL_TEST_FAULT (a test hook)")
        recover()

    engine.recover = failing


def _failing_forward(model) -> None:
    """The vLLM model's forward raising at the N-th call of the named RL step, on the last rank only."""
    wanted = [(step, nth) for name, step, nth in _parse("MEGARL_TEST_FAULT") if name == "forward_error_last_rank"]
    if not on_last_rank():
        return
    inner, calls = model.forward, collections.Counter()

    def forward(*args, **kwargs):
        for step, nth in wanted:
            if step == rl_step():
                calls[step] += 1
                if calls[step] == nth:
                    log.info(f"rank {rank_and_world()[0]}: forward error injected by "
                             f"MEGARL_TEST_FAULT at call {nth} of RL step {step} (a test hook)")
                    raise RuntimeError("forward fault injected by MEGARL_TEST_FAULT (a test hook)")
        return inner(*args, **kwargs)

    model.forward = forward


def broken_half_way(weights, total: int):
    """``weights`` raising after ``total // 2`` of its ``total`` tensors."""
    for i, item in enumerate(weights):
        if i >= total // 2:
            raise ConnectionError("sync fault injected by MEGARL_TEST_FAULT (a test hook): the stream broke half-way")
        yield item


def _breaking_loads(engines) -> None:
    load = engines.load

    def breaking(stream, version: int, in_flight: bool = False):
        if injected("sync_error"):
            total = sum(len(pieces) for pieces in stream.piece_plan())
            stream = WeightsOverride(stream, broken_half_way(stream.weights(), total))
        return load(stream, version, in_flight)

    engines.load = breaking


def _dying_audit(weight_sync, engines) -> None:
    audit = weight_sync.audit

    def dying(eng, version: int) -> float:
        if injected("replica_dies_before_audit") and engines.clients:
            log.info("engine replica 0 killed by MEGARL_TEST_FAULT (a test hook)")
            engines.clients[0].proc.kill()
            engines.clients[0].proc.join(30)
        return audit(eng, version)

    weight_sync.audit = dying


def _one_replica_fails(client) -> None:
    """This replica's updates of the step get a plan whose last 2-D tensor is transposed (same bytes, so the
    broadcast stays in step): its load fails and it keeps serving its old weights."""
    call = client.call

    def failing(msg, reply: bool = True):
        if isinstance(msg, Update) and not msg.stage_only and injected("replica_load_error"):
            plan = [list(pieces) for pieces in msg.plan]
            b, j = next((b, j) for b in reversed(range(len(plan))) for j, (_, shape) in enumerate(plan[b])
                        if len(shape) == 2 and shape[0] != shape[1])
            name, shape = plan[b][j]
            plan[b][j] = (name, (shape[1], shape[0]))
            log.info(f"engine replica {client.index}: its weight update's plan broken by MEGARL_TEST_FAULT "
                     "(a test hook)")
            msg = dataclasses.replace(msg, plan=plan)
        return call(msg, reply)

    client.call = failing


def faulty_optimizer_steps(trainer) -> None:
    """The optimizer step hooks (``nan_grad``, ``optimizer_hang``, the ``optimizer_step`` kill point) in ``trainer``,
    a ``PolicyTrainer``: after the backward, before the step's non-finite check."""
    grads = trainer.grad_buffers

    def faulty():
        kill_point("optimizer_step")
        if injected("optimizer_hang") and on_last_rank():
            hang_forever("optimizer step")  # its peers block in the non-finite check's all-reduce
        out = grads()
        if injected("nan_grad") and out:
            out[0][0] = float("nan")
        return out

    trainer.grad_buffers = faulty


def _signalled_warmup(trainer) -> None:
    """The ``warmup_step`` point after each of ``trainer``'s steps before the first RL step (the warm-up's)."""
    train_step, taken = trainer.train_step, [0]

    def step(*args, **kwargs):
        out = train_step(*args, **kwargs)
        if rl_step() == 0:
            taken[0] += 1
            signal_point("warmup_step", taken[0])
        return out

    trainer.train_step = step


def kill_checkpoint_writer() -> None:
    """SIGKILL megatron's checkpoint-writer Manager process of this process, if one runs."""
    process = checkpoint_writer_process()
    if process is not None and process.is_alive():
        log.info(f"rank {rank_and_world()[0]}: checkpoint writer helper (pid {process.pid}) killed by "
                 "MEGARL_TEST_FAULT (a test hook)")
        process.kill()
        process.join(10)


def _faulty_saves(saver) -> None:
    save, write_files = saver.save, saver.write_files

    def faulty_save(step: int, state):
        if injected("checkpoint_writer_dies"):
            kill_checkpoint_writer()
        return save(step, state)

    def faulty_write(tmp, state) -> None:
        if injected("checkpoint_writer_dies_mid_save"):
            kill_checkpoint_writer()
        write_files(tmp, state)
        kill_point("checkpoint_write")

    saver.save, saver.write_files = faulty_save, faulty_write
