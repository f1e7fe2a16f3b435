"""A run's checkpoint calls: every learner's megatron dist checkpoint and the run's state, saved and resumed together.

``RunSaver.save`` writes one ``run.RunCheckpoints`` step directory (atomic, verified) holding each learner (policy,
critic, reference) and the state ``session_state.capture`` took; ``resume`` loads the learners of the checkpoint
``train.resume`` names and returns that state for the session to take back. The caller decides when (the keeper:
every ``train.save_every`` steps, on preemption, at the end) and keeps generation still meanwhile.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path

from megarl.checkpoint.dist import load_checkpoint, save_checkpoint
from megarl.checkpoint.run import RunCheckpoints, resolve_resume
from megarl.checkpoint.session_state import read_state, write_state
from megarl.compat.megatron import drop_dead_checkpoint_writer
from megarl.distributed.collectives import rank_and_world

log = logging.getLogger(__name__)


class SaveFailed(RuntimeError):
    """A run checkpoint could not be written because a helper process of megatron's writer died during the save
    (not a fault of the run's state): ``megarl train`` exits ``EXIT_REQUEUE``, and the rerun resumes from the last
    complete checkpoint (the failed save's ``.tmp`` directory is never read)."""


class RunSaver:
    """The checkpoints of ``run_dir`` for ``learners`` ((name, trainer) pairs; a frozen one is saved without an
    optimizer)."""

    def __init__(self, run_dir: str | Path, keep: int, learners: list[tuple[str, object]]) -> None:
        self.run_dir, self.keep, self.learners = run_dir, keep, learners
        self.ckpts = RunCheckpoints(run_dir, keep)
        self.saved_at = -1  # the step of the last checkpoint saved or resumed from (-1: none)

    def resume(self, spec: str, around=nullcontext) -> tuple[Path, dict] | None:
        """Load the learners of the checkpoint ``spec`` (``train.resume``) names (``resolve_resume``), inside
        ``around()`` (the engines asleep meanwhile: ``Handover.training``); that checkpoint and its run state (this
        rank's RNG states put back), or None for a fresh run."""
        path = resolve_resume(spec, self.run_dir, self.keep)
        if path is None:
            return None
        with around():
            for name, learner in self.learners:
                load_checkpoint(learner, path / name, load_optimizer=learner.optimizer is not None)
        state = read_state(path)
        self.saved_at = state["step"]
        return path, state

    def save(self, step: int, state: dict | None) -> Path:
        """Checkpoint ``step`` done steps on every rank (``state``: rank 0's run state, None elsewhere)."""
        if why := drop_dead_checkpoint_writer():
            log.warning(f"rank {rank_and_world()[0]} checkpoint save of step {step}: {why}")
        try:
            path = self.ckpts.save(step, lambda tmp: self.write_files(tmp, state))
        except (BrokenPipeError, EOFError, ConnectionError) as exc:  # a helper process of the writer died mid-save
            raise SaveFailed(
                f"checkpoint save of step {step} failed: a helper process of megatron's checkpoint writer died "
                f"({type(exc).__name__}: {exc}); nothing of this save is used (its .tmp directory is ignored): "
                f"rerun the same command to resume from the last complete checkpoint "
                f"(step {self.saved_at if self.saved_at >= 0 else 'none yet'})") from exc
        self.saved_at = step
        return path

    def write_files(self, tmp: Path, state: dict | None) -> None:
        """The checkpoint's files into the step's temporary directory: each learner's, then the run state."""
        for name, learner in self.learners:
            save_checkpoint(learner, tmp / name)
        write_state(tmp, state)
