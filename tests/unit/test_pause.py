"""No drain where none is needed (``rollout/pipeline.py``'s ``pause``): a checkpoint or an evaluation under async
stops generation between two engine steps, the phase in flight suspended and its progress in the controller's state,
which a resumed run generates on from; a preemption while the trainer waits for a batch ends the wait at once; a
checkpoint generated ahead under another overlap mode is re-queued on resume; nothing is generated past the run's
last step. The real controller on simulated engines, slowed so that a phase takes many steps."""

from __future__ import annotations

import pickle
import threading
import time

import pytest

import megarl.distributed.signals as signals
from megarl.rollout.controller import ControllerConfig, PromptItem, RolloutController
from megarl.rollout.phase_metrics import PhaseMetrics
from megarl.rollout.pipeline import PhaseInterrupted, Pipeline, Preempted, Rollout
from megarl.rollout.sim.engines import SimulatedEngine, StepTimeModel
from megarl.types import SampleStatus

pytestmark = pytest.mark.alone  # a pause must release within 2 s: never beside another test (make test)


class SlowEngine(SimulatedEngine):
    """A simulated engine whose steps take real time (a phase of minutes, scaled down)."""

    def step(self):
        time.sleep(0.005)
        return super().step()


def controller(gate, first: int = 0) -> RolloutController:
    items = iter(range(first, 10**6))
    lengths = [3, 4, 60, 80]  # two short and two long samples per group: groups complete while others run
    cfg = ControllerConfig(mode="partial", group_size=4, update_groups=4, rollout_groups=8, max_tokens=100,
                           staleness_limit=2)
    engines = [SlowEngine(8, lambda key: lengths[key[1]], StepTimeModel("constant", 1.0), max_chunk=1)]
    return RolloutController(cfg, engines, lambda: PromptItem(next(items), [1, 2, 3]), engine_turn=gate)


def test_a_checkpoint_under_async_pauses_the_phase_in_flight_and_keeps_its_progress():
    p: Pipeline
    ctrl = None

    def generate(version, batch):
        groups, m = ctrl.run_phase(version)
        return Rollout(groups, m, {}, batch)

    p = Pipeline("async", generate, 2)
    ctrl = controller(p.gate.step)
    p._ensure_thread()
    deadline = time.monotonic() + 10
    while not (ctrl.in_phase and any(x.status is SampleStatus.RUNNING for g in ctrl.live.values() for x in g.samples)):
        assert time.monotonic() < deadline, "the phase never released a group while others ran"
        time.sleep(0.002)
    start = time.perf_counter()
    with p.pause():
        paused_s = time.perf_counter() - start
        assert p._busy  # within one engine step: the phase is suspended, not drained
        state = pickle.loads(pickle.dumps(ctrl.state_dict()))
        tokens = sum(len(x.response_ids) for g in ctrl.live.values() for x in g.samples)
        time.sleep(0.05)  # nothing moves while paused
        assert sum(len(x.response_ids) for g in ctrl.live.values() for x in g.samples) == tokens
    assert paused_s < 1.0
    p.close()  # the phase in flight stops between two engine steps
    assert isinstance(p.error, PhaseInterrupted)
    held = set(state["live"])  # the groups the checkpoint holds mid-generation (prompts below 500)
    assert len(held) >= 4 and not held & set(state["released"])
    resumed = controller(lambda: threading.Lock(), first=500)  # a fresh run resumed (its source restored too)
    resumed.load_state_dict(state)
    statuses = {x.status for g in resumed.live.values() for x in g.samples}
    assert SampleStatus.RUNNING not in statuses and SampleStatus.CONSUMED not in statuses
    assert any(len(x.response_ids) for g in resumed.live.values() for x in g.samples)  # partial samples kept
    groups, _ = resumed.run_phase(0)
    # the batch generated on from there: the held groups first (each further along than any prompt drawn anew)
    assert len(groups) == 4 and {g.prompt_index for g in groups} <= held


def test_a_preemption_ends_the_wait_for_a_batch_at_once():
    release = threading.Event()

    def generate(version, batch):
        release.wait(10)
        return Rollout([], PhaseMetrics(), {}, batch)

    p = Pipeline("async", generate, 1)
    signals._signalled = "SIGTERM"
    try:
        start = time.perf_counter()
        rollout, error = p.take()
        assert rollout is None and isinstance(error, Preempted) and time.perf_counter() - start < 2
    finally:
        signals._signalled = ""
        release.set()
        p.close()


def test_batches_generated_ahead_that_this_run_cannot_train_are_given_back():
    def generate(version, batch):
        return Rollout([], PhaseMetrics(), {}, batch)

    p = Pipeline("async", generate, 2)
    p.queue.extend(Rollout([], PhaseMetrics(), {}, b) for b in (3, 4))
    p.generated, p.done, p.version, p.served = 5, 3, 3, 3
    assert p.untrainable() == [] and len(p.queue) == 2  # async, k 2: both fit
    none = Pipeline("none", generate, 2)
    none.load_state_dict(p.state_dict())
    assert [r.batch for r in none.untrainable()] == [3, 4] and none.generated == 3 and not none.queue
    smaller = Pipeline("async", generate, 0)
    smaller.load_state_dict(p.state_dict())
    assert [r.batch for r in smaller.untrainable()] == [4] and smaller.generated == 4  # batch 4: 1 ahead > k 0


def test_nothing_is_generated_past_the_last_step():
    started = []

    def generate(version, batch):
        started.append(batch)
        return Rollout([], PhaseMetrics(), {}, batch)

    p = Pipeline("async", generate, 3, batches=2)
    for step in range(2):
        rollout, _ = p.take()
        assert rollout.batch == step
        p.step_done(step + 1, step + 1)
    time.sleep(0.05)
    p.close()
    assert started == [0, 1]
