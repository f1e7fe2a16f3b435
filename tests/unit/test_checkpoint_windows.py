"""A run checkpoint taken while rank 0's generating thread is inside one of the windows where it changes what the
checkpoint keeps outside the engines' gate (``helpers/windows.py``; issue 52, fault 8): a stale group dropped, an
episode resumed, a failed phase put back, a batch handed to the pipeline's queue. Each window is slowed, a checkpoint
is taken during the delay as a save takes it (``Pipeline.pause``, then ``session_state.rollout_state``), and the
checkpoint must hold every prompt the source drew exactly once (live, re-queued, generated ahead, or trained) and
every episode's instance: nothing lost, nothing twice. The real controller on simulated engines."""

from __future__ import annotations

import contextlib
import pickle
import threading
import time

import pytest

from helpers.windows import slow
from megarl.checkpoint.session_state import IndexedSource, rollout_state
from megarl.rollout.controller import ControllerConfig, PromptItem, RolloutController
from megarl.rollout.phases import PhaseRunner
from megarl.rollout.pipeline import Pipeline
from megarl.rollout.sim.engines import SimulatedEngine, StepTimeModel
from megarl.types import SampleStatus

pytestmark = pytest.mark.alone  # slow env steps under a 2 s timeout: never beside another test (make test)

DELAY = 0.3  # each window's injected delay (s): a checkpoint that must wait for the window waits that long


class SlowEngine(SimulatedEngine):
    """A simulated engine whose steps take real time; ``fail_at``: its step that raises (an engine error)."""

    fail_at = 0

    def step(self):
        time.sleep(0.003)
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == self.fail_at:
            raise RuntimeError("engine died")
        return super().step()


def controller(p: Pipeline, fail_at: int = 0, **kw) -> RolloutController:
    lengths = [3, 4, 40, 60]  # two short and two long samples per group: groups complete while others run
    cfg = ControllerConfig(**{"mode": "partial", "group_size": 4, "update_groups": 2, "rollout_groups": 4,
                              "max_tokens": 100, "staleness_limit": 2, **kw})
    engine = SlowEngine(8, lambda key: lengths[key[1]], StepTimeModel("constant", 1.0), max_chunk=1)
    engine.fail_at = fail_at
    return RolloutController(cfg, [engine], IndexedSource(lambda: PromptItem(0, [1, 2, 3])), lock=p.lock,
                             engine_turn=p.gate.step)


class Figures:
    """The phase runner's reward pool and prompt source, as far as it reads them (their figures)."""

    def step_metrics(self) -> dict:
        return {}

    def metrics(self) -> dict:
        return {}


def async_run(**kw) -> tuple[Pipeline, RolloutController, PhaseRunner]:
    """An async pipeline whose thread generates with the phase runner of a controller that shares its lock."""
    runner: PhaseRunner | None = None
    p = Pipeline("async", lambda version, batch: runner(version, batch, alone=True), 1,
                 handed=lambda: c.hand_over())
    c = controller(p, **kw)
    runner = PhaseRunner(c, Figures(), Figures(), 0, lambda track, name: contextlib.nullcontext())
    return p, c, runner


def checkpoint(p: Pipeline, c: RolloutController) -> dict:
    """What a save keeps of the rollout (``keeper.save``), a copy."""
    with p.pause():
        return pickle.loads(pickle.dumps(rollout_state(c, p)))


def where(state: dict, trained: set[int] = frozenset()) -> set[int]:
    """Every prompt the checkpoint's source drew is in exactly one place: live (in flight or held), re-queued, in the
    long queue, in a batch generated ahead, or ``trained`` before it; the released ones are those last two. The
    prompts live."""
    c = state["controller"]
    ahead = [g.prompt_index for r in pickle.loads(state["pipeline"]["queue"]) for g in r.groups]
    held = [*c["live"], *(item.index for item, *_ in c["requeued"]), *(item.index for item, *_ in c["long_queue"]),
            *ahead, *trained]
    assert sorted(held) == list(range(state["source"]["drawn"])), "a prompt lost or held twice"
    assert c["released"] == set(ahead) | set(trained)
    return set(c["live"])


def resumed(state: dict, **kw) -> RolloutController:
    """A fresh run's controller from the checkpoint (its source restored too)."""
    c = controller(Pipeline("none", lambda version, batch: None, 1), **kw)
    c.next_prompt.load_state_dict(state["source"])
    c.load_state_dict(state["controller"])
    return c


def in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_a_checkpoint_while_a_batch_generated_ahead_joins_the_queue_holds_it_once():
    p, c, runner = async_run()
    window = slow("hand_over", runner.rewards, 10)  # (it ends once the checkpoint is taken)
    p._ensure_thread()
    assert window.entered.wait(10)
    state = checkpoint(p, c)
    window.leave()
    p.close()
    where(state)
    live = state["controller"]["live"]
    batch = {i for i, (_, samples, *_) in live.items() if all(x.status is SampleStatus.CONSUMED for x in samples)}
    assert len(batch) == 2  # the batch in the window: still the controller's, its queue not holding it yet
    groups, _ = resumed(state).run_phase(0)
    assert {g.prompt_index for g in groups} == batch  # a resumed run releases it first, whole


def test_a_checkpoint_while_a_failed_phase_is_put_back_holds_the_prompts_it_drew():
    p, c, runner = async_run(fail_at=12)  # (after the phase drew its prompts and released a group)
    window = slow("phase_restore", c, DELAY)
    p._ensure_thread()
    assert window.entered.wait(10)
    state = checkpoint(p, c)
    p.close()
    assert isinstance(p.error, RuntimeError) and state["source"]["drawn"] >= 4
    assert not where(state)  # the state before the phase (none live), every prompt it drew re-queued
    assert len(state["controller"]["requeued"]) == state["source"]["drawn"]


def test_a_checkpoint_while_a_stale_group_is_dropped_holds_its_prompt():
    p = Pipeline("async", lambda version, batch: None, 1)
    c = controller(p, stale_action="drop", staleness_limit=1)
    first, _ = c.run_phase(0)  # (leaves partial samples of version 0 behind)
    window = slow("expire_stale", c, DELAY)
    phase = in_thread(lambda: c.run_phase(3))  # version 3: the partial samples are 3 versions old, k = 1
    assert window.entered.wait(10)
    state = checkpoint(p, c)
    phase.join(10)
    where(state, trained={g.prompt_index for g in first})
    assert state["controller"]["requeued"]  # (the dropped groups' prompts)


# ---- episodes ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    from megarl.models.tiny import build_tokenizer

    return build_tokenizer()


def test_a_checkpoint_while_a_resumed_episode_is_asked_again_keeps_its_instance(tok, monkeypatch):
    from helpers.scripted import ScriptedEngine
    from megarl.data.chat import TurnRenderer
    from megarl.envs.pool import EnvPool
    from megarl.models.tiny import CHATML_TEMPLATE
    from megarl.rollout.turns import Episodes

    monkeypatch.setenv("SLOW_ENV_S", "0.05")  # (a phase ends with episodes waiting on their answer)
    prompt = tok.apply_chat_template([{"role": "user", "content": "go"}], chat_template=CHATML_TEMPLATE,
                                     add_generation_prompt=True, tokenize=True)["input_ids"]

    def build(p: Pipeline) -> tuple[RolloutController, EnvPool]:
        rows = iter([{"turns": 2}, {"turns": 4}] * 2)
        pool = EnvPool("helpers.envs:Slow", workers=2, timeout_s=2.0)
        cfg = ControllerConfig(mode="partial", group_size=2, update_groups=1, rollout_groups=2, max_tokens=200,
                               staleness_limit=4)
        source = IndexedSource(lambda: next((PromptItem(0, list(prompt), "go", extras=r) for r in rows), None))
        return RolloutController(cfg, [ScriptedEngine(tok, 1)], source, lock=p.lock, episodes=Episodes(
            pool, TurnRenderer(tok, CHATML_TEMPLATE), tok, 4, 200)), pool

    p = Pipeline("async", lambda version, batch: None, 1)
    c, pool = build(p)
    try:
        c.run_phase(0)
        saved = pickle.loads(c.snapshot())
    finally:
        pool.close()
    c, pool = build(p)  # a fresh run (fresh workers) from that checkpoint
    try:
        c.load_state_dict(saved)
        waiting = {(i, j) for i, (_, samples, *_) in saved["live"].items() for j, x in enumerate(samples)
                   if x.status is SampleStatus.WAITING}
        assert waiting and waiting <= set(saved["episodes"]["saved"])  # (the premise: instances to resume)
        window = slow("sweep", c.episodes, DELAY)
        sweep = in_thread(lambda: c.episodes.sweep(c.live))  # (a phase's start: each waiting sample asked again)
        assert window.entered.wait(10)
        state = checkpoint(p, c)
        sweep.join(10)
        assert set(saved["episodes"]["saved"]) <= set(state["controller"]["episodes"]["saved"])  # none lost
    finally:
        pool.close()
