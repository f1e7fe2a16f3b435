"""One controller phase for one batch, put back whole when it fails: what the loop and the pipeline generate with.

A phase that raises (an engine error mid-phase, a replica gone, a preemption signal that stopped the trainer's own
thread's phase between two engine steps: ``PhaseStopped``) leaves the controller as it was before the phase:
its state is pickled first and loaded back, the prompts the phase drew are re-queued (drawn, never trained), and
the reward figures of the groups it scored are dropped (they run again). The keeper then restarts the engines and
generates the batch again; the pipeline's thread hands the error to the trainer's thread, which does the same.

Cost: one pickle of the controller's state per phase (milliseconds for the tiny runs; it grows with the partial
buffer: about a second and 240 MiB for 4,096 buffered samples of 4,000 tokens each, against phases of minutes at
that scale).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable

from megarl.distributed.signals import signalled
from megarl.rollout.pipeline import Rollout

SEED_STRIDE, BATCH_STRIDE = 1_000_003, 7_919


class PhaseRunner:
    """``runner(version, batch)``: the phase for batch ``batch``, trained at ``version``, as a ``Rollout``.

    ``controller``: the run's ``RolloutController`` (its ``next_prompt`` an ``IndexedSource``, which marks what a
    phase draws); ``rewards`` its scorer's pool (``step_metrics`` reads and clears the phase's reward figures);
    ``prompts`` the data source (``metrics``); ``span(track, name)`` the timeline's span."""

    def __init__(self, controller, rewards, prompts, seed: int, span: Callable) -> None:
        self.controller, self.rewards, self.prompts, self.seed, self.span = controller, rewards, prompts, seed, span
        self.requeued = 0  # the new prompts the last failed phase re-queued

    def __call__(self, version: int, batch: int, alone: bool = False) -> Rollout:
        """``alone``: rank 0's phase that it shares with no rank (the pipeline's thread; the trainer's thread
        shares what it takes); otherwise every rank learns the phase (``controller.run_phase``)."""
        c = self.controller
        snapshot = c.snapshot()
        c.next_prompt.mark()
        c.phase_seed = self.seed * SEED_STRIDE + batch * BATCH_STRIDE  # the same state samples alike (resume)
        c.keep_batch = alone  # (the pipeline's thread: the batch stays the controller's until its queue takes it)
        # the trainer's own thread stops its phase at a preemption signal (the run saves what was before it); the
        # pipeline's thread is paused by the save instead (``Pipeline.pause``)
        c.interrupt = (lambda: "") if alone else signalled
        start = time.perf_counter()
        try:
            with self.span("rollout", f"generate batch {batch}"):
                groups, phase = (c.generate if alone else c.run_phase)(version)
        except Exception:
            drawn = list(c.next_prompt.recent)
            with c.lock:  # (one change for a checkpoint: the state before the phase, with the prompts it drew)
                c.load_state_dict(pickle.loads(snapshot))  # (episodes go on from their instances as it kept them)
                c.requeued.extend((item, 0, version) for item in drawn)  # (item, discards, first version)
            self.requeued = len(drawn)
            self.rewards.step_metrics()  # (cleared: the failed phase's scores are not counted)
            raise
        finally:
            c.interrupt = lambda: ""
        figures = {**self.rewards.step_metrics(), **self.prompts.metrics(), "timing/gen_s": time.perf_counter() - start}
        if c.episodes is not None:
            figures.update(c.episodes.pool.metrics())  # env/* counts, timing/env_s
        return Rollout(groups, phase, figures, batch)
