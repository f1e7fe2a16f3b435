"""The pipeline's who-waits-for-whom (``rollout/pipeline.py``) and the timeline's figures (``logging/timeline.py``),
with a plain function as the phase: the bound on how far ahead async runs, one_step's one batch ahead, hold."""

from __future__ import annotations

import json
import threading
import time

import pytest

from megarl.logging.timeline import Timeline, write_trace
from megarl.rollout.phase_metrics import PhaseMetrics
from megarl.rollout.pipeline import Pipeline, Rollout

pytestmark = pytest.mark.alone  # bounds of fractions of a second: never beside another test (make test)


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


def _pipeline(mode, k=1):
    started = []  # (batch, trained at version, steps done when it started)

    def generate(version, batch):
        started.append((batch, version, p.done))
        time.sleep(0.01)
        return Rollout([], PhaseMetrics(), {}, batch)

    p = Pipeline(mode, generate, k)
    return p, started


@pytest.mark.parametrize("k", [0, 1, 2])
def test_async_starts_a_phase_only_within_k_versions_of_the_one_that_trains_it(k):
    p, started = _pipeline("async", k)
    for step in range(6):
        rollout, error = p.take()
        assert error is None and rollout.batch == step
        _wait_for(lambda n=min(step + 1 + k, 6): p.generated >= n)  # training: the thread runs ahead as far as k lets
        time.sleep(0.02)  # (and no further: a phase past the bound would start now)
        p.step_done(step + 1, step + 1)
    p.close()
    assert [b for b, _, _ in started][:6] == list(range(6))
    assert all(batch - done <= k for batch, _, done in started)  # never more than k batches ahead of training
    assert all(version == batch for batch, version, _ in started)  # trained at the version of its turn
    assert any(batch - done == k for batch, _, done in started)  # and it did run ahead


def test_one_step_generates_the_next_batch_while_this_one_trains():
    p, started = _pipeline("one_step")
    rollout, _ = p.take()
    assert rollout is None  # the first batch: the caller generates it now
    p.generated_now()
    for step in range(3):
        p.after_take()  # batch step + 1 starts with the weights now
        assert p.boundary() is None  # the sync waits for it
        p.step_done(step + 1, step + 1)
        rollout, _ = p.take()
        assert rollout.batch == step + 1
    assert [(b, v, d) for b, v, d in started] == [(1, 1, 0), (2, 2, 1), (3, 3, 2)]


def test_hold_lets_no_phase_start_and_waits_for_the_one_running():
    p, started = _pipeline("async", 3)
    p.take()
    with p.hold():
        n = len(started)
        assert not p._busy
        time.sleep(0.05)
        assert len(started) == n  # nothing started inside
        state = p.state_dict()
    p.close()
    restored = Pipeline("async", None, 3)
    restored.load_state_dict(state)
    assert [r.batch for r in restored.queue] == [r.batch for r in p.queue][:len(restored.queue)]
    assert restored.generated == state["generated"]


def test_a_step_sees_a_span_still_open_and_the_overlap_in_its_window(tmp_path):
    """The figures come from the replicas' own engine steps: a phase that steps beside the trainer overlaps it, and
    one held (at the engines' gate, for a sync) leaves the engines idle though its span is open."""
    t = Timeline(keep_all=True, append_to=tmp_path / "trace")
    opened, gate = threading.Event(), threading.Event()

    def phase():
        with t.span("rollout", "generate batch 1"):
            opened.set()
            while not gate.is_set():  # engine steps, back to back: one merged span
                a = time.perf_counter()
                time.sleep(0.001)
                t.add("replica 0", "generate", a, time.perf_counter(), merge=True)

    worker = threading.Thread(target=phase)
    worker.start()
    opened.wait()
    start = time.perf_counter()
    with t.span("trainer rank 0", "train"):
        time.sleep(0.05)
    figures = t.step_metrics(start, time.perf_counter(), "trainer rank 0")  # the phase outlasts the step
    gate.set()
    worker.join()
    assert figures["pipeline/overlap_fraction"] > 0.8 and figures["timing/engine_idle_s"] < 0.01
    path = write_trace(tmp_path / "trace.json", [t.events()])
    events = json.loads(path.read_text())["traceEvents"]
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert set(spans) == {"generate batch 1", "generate", "train"} and all(e["dur"] > 0 for e in spans.values())
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {"rollout", "replica 0", "trainer rank 0"}
    with t.span("rollout", "generate batch 2"):  # a phase held at the gate: its span open, no engine step
        start = time.perf_counter()
        with t.span("trainer rank 0", "sync"):
            time.sleep(0.02)
        held = t.step_metrics(start, time.perf_counter(), "trainer rank 0")
    assert held["pipeline/overlap_fraction"] == 0.0 and held["timing/engine_idle_s"] > 0.015
    # every finished span was appended to this rank's trace as the steps went: a killed run keeps it (a JSON array
    # the Trace Event Format lets stay unterminated)
    (appended,) = (tmp_path / "trace").iterdir()
    kept = json.loads(appended.read_text().rstrip().rstrip(",") + "]")
    assert {e["name"] for e in kept if e["ph"] == "X"} == {"generate batch 1", "generate", "train", "sync"}


def test_async_gates_on_the_version_the_engines_serve_and_hands_a_lagging_batch_to_the_trainer():
    """k = 1 and the syncs of steps 1 and 2 fail (the engines still serve version 0): no phase starts more than k
    versions ahead of what the engines serve; the batch the trainer needs next, which the thread may not start, is
    handed to the trainer's thread (which re-syncs, then generates it), and the thread waits until that is done."""
    p, started = _pipeline("async", 1)
    rollout, _ = p.take()
    assert rollout.batch == 0
    _wait_for(lambda: p.generated >= 2)  # batch 1 too: it trains at version 1, one ahead of the engines' 0
    p.step_done(1, 0)  # step 1's sync failed
    time.sleep(0.05)
    assert p.generated == 2  # batch 2 would train at 2 with the engines at 0: not started
    rollout, _ = p.take()
    assert rollout.batch == 1
    p.step_done(2, 0)  # step 2's sync failed too
    rollout, error = p.take()
    assert rollout is None and error is None  # the trainer's thread generates batch 2 itself
    p.engines_serve(2)  # (the keeper ran the sync again)
    time.sleep(0.05)
    assert p.generated == 2  # the thread does not start batch 2 beside the trainer's own
    p.generated_now()
    _wait_for(lambda: p.generated >= 4)  # batch 3 (trains at 3, engines at 2): within k again
    time.sleep(0.05)
    assert p.generated == 4  # and no further: batch 4 would train at 4
    p.close()
    assert [b for b, _, _ in started] == [0, 1, 3]


def test_one_step_does_not_generate_ahead_with_weights_two_versions_old():
    p, started = _pipeline("one_step")
    p.take()
    p.generated_now()
    p.after_take()  # batch 1 with the engines at 0, trained at 1: one_step's one version
    assert p.boundary() is None
    p.step_done(1, 0)  # the sync failed: engines at 0
    rollout, _ = p.take()
    assert rollout.batch == 1
    p.after_take()  # batch 2 would train at 2 with the engines at 0: not ahead
    assert p.boundary() is None and p.take() == (None, None)  # the trainer's thread generates it at its turn
    assert [b for b, _, _ in started] == [1]


def _gated_pipeline(k=2):
    """async whose phases each wait for ``release`` (a phase in flight as long as the test wants)."""
    started, release = [], threading.Event()

    def generate(version, batch):
        started.append(batch)
        release.wait(10)
        release.clear()
        return Rollout([], PhaseMetrics(), {}, batch)

    return Pipeline("async", generate, k), started, release


def test_async_loads_at_the_phase_boundary_when_the_trainer_waits_for_that_phase_anyway():
    """The phase in flight is the batch the trainer takes next (none queued): the sync waits for it to end and loads
    with the engines idle, no phase starting meanwhile; with a batch queued the trainer has work, and the load goes in
    flight (the phase's requests recomputed under the new weights)."""
    import megarl.distributed.signals as signals

    p, started, release = _gated_pipeline()
    _ = p._ensure_thread(), release.set()
    rollout, _ = p.take()  # batch 0; batch 1 is in flight
    _wait_for(lambda: started == [0, 1])
    threading.Timer(0.1, release.set).start()
    start = time.monotonic()
    with p.sync() as in_flight:
        assert not in_flight and not p._busy and time.monotonic() - start >= 0.09  # waited for the boundary
        time.sleep(0.05)
        assert started == [0, 1] and [r.batch for r in p.queue] == [1]  # and none started inside
    assert p.boundary_wait_s >= 0.09  # (the trainer's wait: timing/trainer_wait_s)
    p.step_done(1, 1)
    _wait_for(lambda: started == [0, 1, 2])  # after it, the next phase starts at once
    assert p.take()[0].batch == 1
    release.set()
    _wait_for(lambda: len(p.queue) == 1 and started == [0, 1, 2, 3])  # batch 2 queued while 3 runs
    with p.sync() as in_flight:
        assert in_flight  # the trainer has batch 2 to train: no waiting, the load goes in flight
    assert p.boundary_wait_s == 0.0
    p.step_done(2, 2)
    assert p.take()[0].batch == 2  # (batch 3 in flight, nothing queued)
    signals._signalled = "SIGTERM"
    try:
        start = time.monotonic()
        with p.sync() as in_flight:  # a preemption does not wait for the phase
            assert in_flight and time.monotonic() - start < 2
    finally:
        signals._signalled = ""
    release.set()
    p.close()



def test_the_batch_staleness_counts_the_models_tokens_not_the_environments():
    """``rollout/staleness`` (the keeper's count against the version that trains a batch) is over the tokens the
    model sampled, as the controller's: an environment's message carries the version of the token before it and
    is never trained."""
    from megarl.rollout.pipeline import staleness
    from megarl.types import Group, Sample

    s = Sample(prompt_ids=[1], response_ids=[5, 6], versions=[0, 1])
    s.add_env_turn({"role": "tool", "content": "42"}, [7, 8, 9])  # three environment tokens (version 1)
    s.response_ids += [10]
    s.versions += [2]
    assert staleness([Group(prompt_index=0, prompt_text="", answer="", samples=[s])], 2) == {2: 1, 1: 1, 0: 1}
    assert s.model_versions() == [0, 1, 2]
