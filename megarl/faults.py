"""The run's fault policy: what each fault leads to, counted for ``faults/*`` and kept in run checkpoints.

::

    fault                                                    decision
    an engine error (a phase, a sync or its audit, an eval)  RESTART the engines, then what failed runs again;
                                                             STOP after engine.max_restarts in a row, or when
                                                             the restart is refused (exit 75: requeue)
    an evaluation still failing with no restart left         SKIP it (NaN, faults/evals_skipped); the run goes on
    a non-finite loss or gradient (the trainer skipped it)   GO_ON; STOP after train.max_bad_steps in a row (exit 1)
    every reward call failing reward.max_failed_steps steps  STOP, fatal (exit 1, never requeued)
    a data error (no usable row)                             STOP, fatal

The policy decides and counts; the keeper (``keeper.py``) carries the decisions out. Every rank reaches the same
decision: the errors it is given are agreed across ranks first.
"""

from __future__ import annotations

import enum
import logging
import traceback
from dataclasses import dataclass

log = logging.getLogger(__name__)


class Action(enum.Enum):
    GO_ON = "go on"
    RESTART = "restart"
    SKIP = "skip"
    STOP = "stop"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str = ""
    """Why the run stops (``STOP``), or what was skipped."""
    fatal: bool = False
    """``STOP`` for a fault that is not the engines' (data, rewards, non-finite steps): exit 1, never requeued."""


GO_ON = Decision(Action.GO_ON)


def one_line(exc: BaseException) -> str:
    return traceback.format_exception_only(exc)[-1].strip()


def release_frames(exc: BaseException | None) -> None:
    """Drop the locals of the frames ``exc``'s traceback (and those of its causes) ran through: an engine's error
    raised out of vLLM's frames keeps its model runner, weights and KV cache reachable through them, which on a GPU
    a fresh engine started after it then finds still allocated. Frames still running are left (Python refuses);
    each frame's file and line stay for printing."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


class FaultPolicy:
    """``engine.max_restarts``, ``train.max_bad_steps`` and ``reward.max_failed_steps`` applied; ``say`` gets the
    log line of each fault (a warning on rank 0)."""

    def __init__(self, max_restarts: int, max_bad_steps: int, max_failed_reward_steps: int, rank: int = 0,
                 say=None) -> None:
        self.max_restarts, self.max_bad_steps = max_restarts, max_bad_steps
        self.max_failed_reward_steps, self.rank = max_failed_reward_steps, rank
        self.say = say or log.warning
        self.restarts = 0  # engine restarts over the run (faults/engine_restarts)
        self.failing = 0  # engine failures since the last phase or evaluation that completed
        self.evals_skipped = 0  # evaluations given up after engine.max_restarts restarts (faults/evals_skipped)
        self.bad_in_a_row = 0
        self.bad_total = 0  # non-finite steps over the run (faults/nonfinite_steps)

    # ---- engines ------------------------------------------------------------------------------------------------
    def engine_error(self, exc: BaseException, what: str, done: str) -> Decision:
        """An engine error in ``what``; ``done``: what is done about it (said with the decision)."""
        self.restarts += 1
        self.failing += 1
        where, limit = one_line(exc), self.max_restarts
        then = f"restart {self.failing}/{limit}" if self.failing <= limit else f"no restart left ({limit} in a row)"
        log.warning(f"rank {self.rank} {what} ({where}); {done}; {then}")
        if self.failing > limit:
            return Decision(Action.STOP, f"engine failed {self.failing} times in a row (engine.max_restarts={limit}); "
                                         f"last: {where}")
        return Decision(Action.RESTART)

    def engine_ok(self) -> None:
        """A phase or an evaluation completed: the failures in a row start again from 0."""
        self.failing = 0

    def eval_given_up(self, step: int, why: str) -> Decision:
        """An evaluation that still fails with no restart left: skipped, the run goes on."""
        self.evals_skipped += 1
        self.say(f"evaluation at step {step} skipped (faults/evals_skipped {self.evals_skipped}): {why}")
        return Decision(Action.SKIP, why)

    # ---- the trainer and the rewards ----------------------------------------------------------------------------
    def after_step(self, step: int, nonfinite: list[str]) -> Decision:
        """After RL step ``step`` (1-based): ``nonfinite`` names each learner whose step was skipped for a non-finite
        loss or gradient (e.g. 'policy loss')."""
        if not nonfinite:
            self.bad_in_a_row = 0
            return GO_ON
        self.bad_in_a_row += 1
        self.bad_total += 1
        what = ", ".join(nonfinite)
        self.say(f"step {step}: non-finite {what}; optimizer step skipped, weights unchanged "
                 f"({self.bad_in_a_row} in a row)")
        if self.max_bad_steps and self.bad_in_a_row >= self.max_bad_steps:
            return Decision(Action.STOP, f"step {step}: {self.bad_in_a_row} steps in a row with a non-finite {what} "
                                         f"(train.max_bad_steps={self.max_bad_steps}); stopping", fatal=True)
        return GO_ON

    def rewards(self, failing_steps: int, reward: str) -> Decision:
        """Before a step's phase: ``failing_steps`` in a row in which every reward call failed."""
        limit = self.max_failed_reward_steps
        if limit and failing_steps >= limit:
            return Decision(Action.STOP, f"every reward call failed in the last {limit} steps "
                                         f"(reward.max_failed_steps); reward.fn={reward!r}: the first failure's "
                                         "traceback is logged above", fatal=True)
        return GO_ON

    # ---- figures and checkpoints --------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        return {"faults/nonfinite_steps": float(self.bad_total), "faults/engine_restarts": float(self.restarts),
                "faults/evals_skipped": float(self.evals_skipped)}

    def state_dict(self) -> dict:
        return {"bad_steps": {"in_a_row": self.bad_in_a_row, "total": self.bad_total},
                "engine_restarts": self.restarts, "evals_skipped": self.evals_skipped}

    def load_state_dict(self, state: dict) -> None:
        bad = state.get("bad_steps", {"in_a_row": 0, "total": 0})
        self.bad_in_a_row, self.bad_total = bad["in_a_row"], bad["total"]
        self.restarts, self.evals_skipped = state.get("engine_restarts", 0), state.get("evals_skipped", 0)
