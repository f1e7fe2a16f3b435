"""Environments in the sandboxed pool and across the controller's turns: instances per episode, failures contained
and counted (raise, hang, wrong type, a killed worker), a waiting sample holding no engine slot, the reward's
transcript, and ``env.*`` checked before launch."""

import json
import pickle
import re
import time

import pytest

from helpers.scripted import ScriptedEngine
from megarl.config.errors import ConfigError
from megarl.config.schema import RunConfig
from megarl.config.validate import validate
from megarl.data.chat import TurnRenderer
from megarl.envs.base import check_env_call, load_env_class
from megarl.envs.pool import EnvPool
from megarl.models.tiny import CHATML_TEMPLATE, build_tokenizer
from megarl.rewards.pool import RewardPool
from megarl.rollout.controller import ControllerConfig, PromptItem, RolloutController
from megarl.rollout.scoring import group_scorer
from megarl.rollout.turns import Episodes
from megarl.types import SampleStatus

pytestmark = pytest.mark.alone  # an env hang cut between 2 and 6 s: never beside another test (make test)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def pool():
    p = EnvPool("helpers.envs:Countdown", workers=2, timeout_s=2.0)
    yield p
    p.close()


def results(pool, n, limit=10.0):
    out, deadline = {}, time.time() + limit
    while len(out) < n and time.time() < deadline:
        out.update({r.key: r for r in pool.poll(1.0)})
    return out


def test_a_call_counts_the_time_its_step_took_not_the_time_its_answer_waited_to_be_collected():
    """``timing/env_s`` and a result's ``seconds``: the step's own 0.3 s, though the answer waits 1.5 s in the pipe
    (an engine step ran meanwhile); counted as the dispatch-to-collection time before."""
    p = EnvPool("helpers.envs:Sleepy", workers=1, timeout_s=5.0)
    try:
        p.submit("a", {"turns": 3, "delay": 0.3}, "hello")
        time.sleep(1.5)
        got = results(p, 1)["a"]
        assert got.message is not None and 0.3 <= got.seconds < 1.0, got.seconds
        assert 0.3 <= p.metrics()["timing/env_s"] < 1.0
    finally:
        p.close()


def test_an_instance_per_episode_keeps_its_state_across_calls(pool):
    replies = []
    for _ in range(3):
        for key in ("a", "b"):
            pool.submit(key, {"turns": 3}, "hello")
        got = results(pool, 2)
        replies.append((got["a"].message, got["b"].message))
    assert replies[0][0] == replies[0][1] == {"role": "tool", "content": "tool: turn 1 had 5 chars"}
    (a, b) = replies[1]  # the second turn: a user message naming the worker process that holds the instance
    assert a["role"] == b["role"] == "user" and a["content"] != b["content"]  # two episodes, two workers
    assert replies[2] == (None, None)  # the third turn ends them
    first = [("tool", "tool: turn 1 had 5 chars")]
    pool.submit("c", {"turns": 3}, "hello")
    assert [(m["role"], m["content"]) for m in [results(pool, 1)["c"].message]] == first
    pool.end("c")
    pool.submit("c", {"turns": 3}, "hello")  # ended: a new instance, from its first turn
    assert results(pool, 1)["c"].message["content"] == first[0][1]
    for key in "abc":
        pool.end(key)


def test_raise_hang_wrong_type_and_a_dead_worker_end_their_episode_counted(pool):
    before = pool.state_dict()
    for mode in ("raise", "type", "exit"):
        pool.submit(mode, {"mode": mode}, "x")
    got = results(pool, 3)
    assert "RuntimeError: the tool broke" in got["raise"].error and got["raise"].kind == "error"
    assert "step returned int 42" in got["type"].error and got["type"].kind == "error"
    assert "worker died" in got["exit"].error
    assert pool.errors - before["errors"] == 3
    # a hang: the worker is killed past timeout_s; the other episode it held is lost, the other worker's is not
    for key in ("s0", "s1"):
        pool.submit(key, {"turns": 5}, "x")
    results(pool, 2)
    start = time.time()
    pool.submit("hang", {"mode": "hang"}, "x")
    held = [k for k in ("s0", "s1") if pool._home[k] == pool._home["hang"]]  # (episodes its worker holds)
    got = results(pool, 1, limit=8)
    assert got["hang"].kind == "timeout" and 2.0 <= time.time() - start < 6
    assert pool.timeouts - before["timeouts"] == 1
    for key in ("s0", "s1"):
        pool.submit(key, {"turns": 5}, "x")
    got = results(pool, 2)
    lost = [k for k in ("s0", "s1") if got[k].kind == "lost"]
    assert lost == held and len(held) == 1 and pool.lost - before["lost"] == 1  # the other worker's goes on
    assert got[({"s0", "s1"} - set(lost)).pop()].message["role"] == "user"  # its second turn


def test_a_bad_env_fn_is_refused_before_any_episode_naming_the_key():
    with pytest.raises(ValueError, match=r"env.fn='helpers.envs:not_a_class' names a function, not a class"):
        load_env_class("helpers.envs:not_a_class")
    with pytest.raises(ValueError, match="has no method step"):
        load_env_class("helpers.envs:NoStep")
    with pytest.raises(ValueError, match=r"a file path.*env.fn=helpers.envs:Countdown"):
        load_env_class("helpers/envs.py:Countdown")
    with pytest.raises(ValueError, match=r"Strict.__init__.*cannot be called as Strict\(\*\*row_extras\).*difficulty"):
        check_env_call("helpers.envs:Strict", {"difficulty": 3})
    check_env_call("helpers.envs:Countdown", {"difficulty": 3})
    with pytest.raises(ValueError, match="env.fn='helpers.envs:Nope'"):
        EnvPool("helpers.envs:Nope", workers=1)


@pytest.mark.parametrize("override,key", [({"env.max_turns": 0}, "env.max_turns"),
                                          ({"env.timeout_s": 0}, "env.timeout_s"),
                                          ({"env.fn": "Countdown"}, "env.fn='Countdown'")])
def test_bad_env_values_are_refused_naming_the_key(override, key):
    cfg = RunConfig()
    cfg.env.fn, cfg.rollout.mode, cfg.rollout.overlap = "helpers.envs:Countdown", "partial", "async"
    cfg.engine.placement = "disaggregated"
    validate(cfg, 1)  # (every rollout mode and overlap takes an environment)
    for dotted, value in override.items():
        section, name = dotted.split(".")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match=key.replace("(", r"\(")):
        validate(cfg, 1)


def test_several_trainer_processes_are_accepted():  # (rank 0 runs the environments: test_env_lockstep.py)
    cfg = RunConfig()
    cfg.env.fn, cfg.rollout.mode, cfg.rollout.overlap = "helpers.envs:Countdown", "sync", "none"
    validate(cfg, 2)


# ---- the controller across turns ------------------------------------------------------------------------------
def controller(tok, rows, slots=1, max_tokens=200, max_turns=4, reward="helpers.envs:transcript_turns",
               env="helpers.envs:Countdown", **kw):
    renderer = TurnRenderer(tok, CHATML_TEMPLATE)
    prompt = tok.apply_chat_template([{"role": "user", "content": "go"}], chat_template=CHATML_TEMPLATE,
                                     add_generation_prompt=True, tokenize=True)["input_ids"]
    pool = EnvPool(env, workers=2, timeout_s=2.0)
    rewards = RewardPool(reward, workers=1, timeout_s=10)
    items = iter(PromptItem(i, list(prompt), "go", "", key=i, extras=row) for i, row in enumerate(rows))
    engine = ScriptedEngine(tok, slots)
    cfg = ControllerConfig(**{"mode": "sync", "group_size": 2, "update_groups": len(rows), "max_tokens": max_tokens,
                              **kw})
    c = RolloutController(cfg, [engine], lambda: next(items, None), score=group_scorer(tok, rewards),
                          episodes=Episodes(pool, renderer, tok, max_turns, max_tokens))
    return c, engine, pool, rewards

def one_phase(c, pool, rewards):
    """The controller's phase 0, its environments' workers and reward pool closed after it, whatever it raised."""
    try:
        return c.run_phase(0)
    finally:
        pool.close()
        rewards.close()



def test_a_sync_phase_runs_episodes_across_turns_with_waiting_samples_holding_no_slot(tok, monkeypatch):
    monkeypatch.setenv("SLOW_ENV_S", "0.2")  # (a slow tool: the slot a waiting sample freed is taken meanwhile)
    c, engine, pool, rewards = controller(tok, [{"turns": 3}, {"turns": 3, "mode": "raise"}], env="helpers.envs:Slow")
    groups, m = one_phase(c, pool, rewards)
    ok, failed = sorted(groups, key=lambda g: g.prompt_index)
    for s in ok.samples:
        assert s.status == SampleStatus.CONSUMED and s.turns == 3 and not s.env_error
        turns = [tok.decode(ids) for role, ids in s.segments() if role == "assistant"]
        assert turns == [f"turn {n} of sample {ok.samples.index(s)}<|im_end|>" for n in range(3)]
        assert [m["role"] for m in s.env_messages] == ["tool", "user"]
        assert len(s.logprobs) == len(s.versions) == len(s.response_ids)
        assert s.reward == 1.0  # the reward read the transcript: 3 assistant turns
        assert s.text == f"turn 2 of sample {ok.samples.index(s)}"  # scored on the last model turn
    for s in failed.samples:  # the environment raised on the first turn: the episode ended there, scored
        assert s.turns == 1 and "RuntimeError: the tool broke" in s.env_error and s.reward == 0.0
    # one slot, four samples: a sample's second turn ran only after other samples took the slot it freed
    first_turns = [i for i, (key, generated) in enumerate(engine.log) if generated == 0]
    assert engine.log.index(((0, 0), len(ok.samples[0].segments()[0][1]) + ok.samples[0].env_spans[0][1]
                             - ok.samples[0].env_spans[0][0])) > first_turns[1]
    summary = m.summary()
    assert summary["rollout/turns_mean"] == pytest.approx((3 * 2 + 1 * 2) / 4)
    assert summary["rollout/turns_max"] == 3 and summary["rollout/env_errors"] == 2
    assert summary["rollout/tool_calls"] == 2 * 3 + 2  # three calls per good episode (the last ends it), one per bad
    env_tokens = sum(s.env_tokens for s in ok.samples)
    model = sum(s.model_tokens for g in groups for s in g.samples)
    assert summary["rollout/env_token_fraction"] == pytest.approx(env_tokens / (env_tokens + model))
    assert summary["rollout/len_trained_mean"] == pytest.approx(model / 4)  # the model's tokens only
    assert sum(m.staleness.values()) == model  # the staleness histogram counts the model's tokens too
    assert pool.calls == 8 and pool.errors == 2
    issue_names = {"rollout/turns_mean", "rollout/turns_max", "rollout/tool_calls", "rollout/env_errors",
                   "rollout/env_token_fraction", "timing/env_s"}  # (the names issue 40 asks for: stable)
    assert issue_names <= set(summary) | set(pool.metrics())


def test_max_turns_and_max_tokens_bound_an_episode(tok):
    c, _, pool, rewards = controller(tok, [{"turns": 9}], max_turns=2)
    try:
        (group,), _ = c.run_phase(0)
        assert [s.turns for s in group.samples] == [2, 2] and all(s.finish_reason == "stop" for s in group.samples)
    finally:
        pool.close()
        rewards.close()
    for cap in (40, 80):
        c, engine, pool, rewards = controller(tok, [{"turns": 9}], max_tokens=cap)
        (group,), _ = one_phase(c, pool, rewards)
        for s in group.samples:  # every token of the trajectory counts: the model's turns and the environment's
            assert len(s.response_ids) <= cap and s.finish_reason == "length"
            assert s.turns == 1 if cap == 40 else 2 <= s.turns < 9  # 40: the first answer does not fit
        assert all(generated + r <= cap for (_, generated), r in zip(engine.log, engine.budgets))


def assert_whole_episodes(tok, groups):
    for g in groups:
        for j, s in enumerate(g.samples):
            said = [tok.decode(ids) for role, ids in s.segments() if role == "assistant"]
            assert said == [f"turn {n} of sample {j}<|im_end|>" for n in range(g.extras["turns"])]
            assert not s.env_error
            assert len(s.logprobs) == len(s.versions) == len(s.response_ids)


@pytest.mark.parametrize("mode", ["partial", "on_policy"])
def test_episodes_go_on_across_phases(tok, mode, monkeypatch):
    """One slot, one group a phase: episodes still waiting (or running) when a phase ends go on in the next
    (partial: kept, their tokens' versions span the phases; on-policy: the group is discarded, its prompt re-run,
    its episodes ended and started afresh); no episode is lost or mixed up with another."""
    rows = [{"turns": 2}, {"turns": 4}] * 2  # (a short episode's group released, a long one's still going)
    monkeypatch.setenv("SLOW_ENV_S", "0.05")  # (a slow tool: a phase ends with the other group's episodes unfinished)
    c, engine, pool, rewards = controller(tok, rows, env="helpers.envs:Slow", mode=mode, update_groups=1,
                                          rollout_groups=2, staleness_limit=4, max_discards=100)
    released, wasted, keys = [], 0, set()
    try:
        for version in range(12):
            groups, m = c.run_phase(version)
            released += groups
            wasted += m.tokens_wasted
            keys |= set(c.episodes.keys.values())
            if len(released) >= 4:
                break
        assert {g.prompt_index for g in released} == {0, 1, 2, 3}
        assert_whole_episodes(tok, released)
        if mode == "partial":
            assert any(len(set(s.versions)) > 1 for g in released for s in g.samples)  # spanned phases
        else:  # discarded mid-episode and run again from the prompt: a new episode under a new key
            assert wasted > 0 and len(keys) > 4 * 2
        assert pool.errors == pool.timeouts == pool.lost == 0
        c.episodes.sweep(c.live)  # (the released groups' episodes end: nothing left in the workers)
        assert not c.episodes.keys and not pool._home
    finally:
        pool.close()
        rewards.close()


def run_until(c, n, first_version=0):
    released = []
    for version in range(first_version, first_version + 12):
        groups, _ = c.run_phase(version)
        released += groups
        if len(released) >= n:
            break
    return released


def messages(groups):
    """Each sample's environment messages, the worker's pid (``go on (PID)``) replaced: what the instances said."""
    return {(g.prompt_index, j): [(m["role"], re.sub(r"\(\d+\)", "(pid)", m["content"])) for m in s.env_messages]
            for g in groups for j, s in enumerate(g.samples)}


def interrupted(tok, env, rows, **kw):
    """A partial run's first phase, then its controller's state as a checkpoint holds it (its workers closed: what a
    kill -9 leaves), loaded into a fresh controller with a fresh pool; (state, the fresh controller, pool, rewards)."""
    c, _, pool, rewards = controller(tok, rows, env=env, **kw)
    try:
        c.run_phase(0)
        state = c.snapshot()
    finally:
        pool.close()
        rewards.close()
    c, _, pool, rewards = controller(tok, rows, env=env, **kw)
    c.load_state_dict(pickle.loads(state))
    kept = pickle.loads(state)
    drawn = set(kept["live"]) | kept["released"] | {item.index for item, *_ in kept["requeued"]}
    source = c.next_prompt  # (the source goes on past what the first run drew, as a resumed run's does)
    c.next_prompt = lambda: next((x for x in iter(source, None) if x.index not in drawn), None)
    return kept, c, pool, rewards


PARTIAL = {"mode": "partial", "update_groups": 1, "rollout_groups": 2, "staleness_limit": 4}


def test_a_resume_mid_episode_goes_on_from_the_instances_the_checkpoint_kept(tok, monkeypatch):
    """A run checkpoint keeps each picklable instance as it was after its last answer: a fresh run (new workers)
    loaded from it continues every episode where it was, a sample that waited on its answer asked again, and the
    instances say what an uninterrupted run's say (their turn counts and the pid of the worker that first built
    them carried over)."""
    monkeypatch.setenv("SLOW_ENV_S", "0.05")
    rows = [{"turns": 2}, {"turns": 4}] * 2
    state, c, pool, rewards = interrupted(tok, "helpers.envs:Slow", rows, **PARTIAL)
    mid = [s for _, samples, _, _ in state["live"].values() for s in samples
           if s.env_messages or s.status == SampleStatus.WAITING]
    assert mid and state["episodes"]["saved"]  # (the checkpoint caught episodes unfinished, with instances)
    try:
        released = run_until(c, 3, 1)
        assert {g.prompt_index for g in released} == {1, 2, 3}
        assert_whole_episodes(tok, released)  # every turn of every episode, none lost or ended early
        assert pool.resumed == len(mid) and pool.restarted == pool.lost == pool.errors == 0
        for g in released:
            for s in g.samples:
                pids = {m["content"] for m in s.env_messages if m["role"] == "user"}
                assert len(pids) <= 1  # one instance for the whole episode, across the resume
    finally:
        pool.close()
        rewards.close()
    c, _, pool, rewards = controller(tok, rows, env="helpers.envs:Slow", **PARTIAL)
    try:
        straight = run_until(c, 4)
    finally:
        pool.close()
        rewards.close()
    want = messages(straight)
    assert all(want[where] == said for where, said in messages(released).items())


def test_a_resume_restarts_the_episodes_whose_instance_cannot_be_pickled_and_says_so(tok, monkeypatch, caplog):
    monkeypatch.setenv("SLOW_ENV_S", "0.05")
    rows = [{"turns": 2}, {"turns": 4}] * 2
    state, c, pool, rewards = interrupted(tok, "helpers.envs:Unpicklable", rows, **PARTIAL)
    mid = [s for _, samples, _, _ in state["live"].values() for s in samples if s.env_messages]
    waiting_first = [s for _, samples, _, _ in state["live"].values() for s in samples
                     if s.status == SampleStatus.WAITING and not s.env_messages]
    assert mid and "cannot pickle" in next(iter(state["episodes"]["unpicklable"].values()))
    try:
        with caplog.at_level("WARNING", logger="megarl.rollout.turns"):
            released = run_until(c, 3, 1)
        assert {g.prompt_index for g in released} == {1, 2, 3}
        assert_whole_episodes(tok, released)  # started again from the prompt, then whole
        assert pool.restarted == len(mid) and pool.resumed == len(waiting_first) and pool.lost == 0
        assert "starts again from its prompt" in caplog.text and "cannot be pickled" in caplog.text
    finally:
        pool.close()
        rewards.close()


def test_megarl_train_refuses_a_class_the_dataset_cannot_build_before_launch(tmp_path):
    """The whole pre-launch sequence (``checked_config``): env.fn is built against the dataset's first row."""
    from megarl.config.validate.prelaunch import checked_config

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "2+3?", "answer": "5", "difficulty": 3}) + "\n")
    run = [f"train.run_dir={tmp_path}", f"model.path={tmp_path / 'model'}", "model.make_tiny=qwen2",
           f"data.path={data}", "reward.fn=exact"]
    with pytest.raises(ValueError, match=r"data.path=.*env.fn='helpers.envs:Strict'.*difficulty"):
        checked_config(None, [*run, "env.fn=helpers.envs:Strict"], 1, command="train")
    checked_config(None, [*run, "env.fn=helpers.envs:Countdown"], 1, command="train")


def test_admission_expects_a_trajectorys_remaining_turns_and_tool_time_not_one_length(tok):
    """Prompt 0 has two short turns and a slow tool, prompt 1 three turns and a fast one: prompt 1's trajectories
    hold more model tokens, yet prompt 0's take longer (its tool time, in the tokens a slot samples meanwhile); the
    next time both come, LPT dispatch runs prompt 0 first, and its expected rest shrinks as its turns are answered."""
    from megarl.rollout.expected import remaining
    from megarl.types import Sample

    c, _, pool, rewards = controller(tok, [{"turns": 2, "delay": 0.3}, {"turns": 3}], env="helpers.envs:Sleepy",
                                     dispatch="lpt", slots=4)
    one_phase(c, pool, rewards)
    assert c.length_cache[1] > c.length_cache[0] and c.turns_cache == {0: 2.0, 1: 3.0}
    assert c.env_cache[0] >= 2 * 0.3 > 10 * c.env_cache[1] and c.token_s > 0
    again = iter([PromptItem(2, [1, 2], key=1), PromptItem(3, [1, 2], key=0)])  # (the same prompts, a new epoch)
    c.next_prompt = lambda: next(again, None)
    c.admit(1, 2)
    assert [i for i, _ in c.run_order(None, set())] == [3, 3, 2, 2]
    assert c._hint(3) > c._hint(2) > c.length_cache[1]
    # a sample's rest: fewer model tokens and fewer environment calls to come after its first answer
    first = remaining(Sample([1]), 20.0, 2.0, 0.6, 0.01)
    s = Sample([1], response_ids=list(range(12)), logprobs=[0.0] * 12, versions=[0] * 12)
    s.add_env_turn({"role": "tool", "content": "x"}, [7, 7])
    assert first == pytest.approx(20 + 60) and remaining(s, 20.0, 2.0, 0.6, 0.01) == pytest.approx(8 + 30)


def test_a_failed_phase_put_back_goes_on_from_the_instances_it_had_before(tok, monkeypatch):
    """An engine error mid-phase: the controller's state from before the phase is loaded back (as ``PhaseRunner``
    does), the same pool still running; the answers of the failed phase's calls are ignored, and each episode goes
    on from its instance as it was before the phase, whole, none lost."""
    monkeypatch.setenv("SLOW_ENV_S", "0.05")
    rows = [{"turns": 2}, {"turns": 4}] * 2
    c, engine, pool, rewards = controller(tok, rows, env="helpers.envs:Slow", **PARTIAL)
    try:
        released, _ = c.run_phase(0)
        before = c.snapshot()
        steps, real = [0], engine.step

        def failing():
            steps[0] += 1
            if steps[0] > 1:
                raise RuntimeError("engine died")
            return real()

        engine.step = failing
        with pytest.raises(RuntimeError, match="engine died"):
            c.run_phase(1)
        engine.step = real
        engine.reset()
        c.load_state_dict(pickle.loads(before))
        mid = sum(1 for g in c.live.values() for s in g.samples if s.env_messages and s.status != SampleStatus.FINISHED)
        released += run_until(c, 3, 1)
        assert {g.prompt_index for g in released} == {0, 1, 2, 3}
        assert_whole_episodes(tok, released)
        assert pool.resumed >= mid > 0 and pool.restarted == pool.lost == pool.errors == 0
    finally:
        pool.close()
        rewards.close()


def test_samples_waiting_on_a_slow_tool_count_as_work_to_come_for_admission(tok, monkeypatch):
    """Two slots, every sample waiting on a slow tool most of the time: the free slots do not admit a group per
    step (the live set grew to the whole source of 60 prompts before), since the waiting samples need them again."""
    monkeypatch.setenv("SLOW_ENV_S", "0.05")
    c, _, pool, rewards = controller(tok, [{"turns": 2}] * 60, env="helpers.envs:Slow", mode="partial",
                                     update_groups=1, rollout_groups=2, slots=2, staleness_limit=4)
    try:
        for version in range(2):
            groups, _ = c.run_phase(version)
            assert len(groups) == 1 and len(c.live) <= 3
    finally:
        pool.close()
        rewards.close()


def test_a_checkpoint_while_a_resumed_episodes_call_is_in_flight_keeps_its_instance(tok, monkeypatch):
    """After a resume, an episode's next call takes its instance out of what the checkpoint handed back; until the
    answer comes, a checkpoint must still hold that instance (the one the call started from: the sample waits, and a
    resume asks again), not lose it and restart the episode from its prompt."""
    monkeypatch.setenv("SLOW_ENV_S", "0.05")
    rows = [{"turns": 2}, {"turns": 4}] * 2
    state, c, pool, rewards = interrupted(tok, "helpers.envs:Slow", rows, **PARTIAL)
    kept = state["episodes"]["saved"]
    try:
        c.episodes.sweep(c.live)  # the samples that waited are asked again at once: their calls in flight
        assert c.episodes.waiting and not set(kept) & set(c.episodes.restore)  # (taken out by those calls)
        assert c.episodes.state_dict()["saved"] == kept
    finally:
        pool.close()
        rewards.close()


def test_an_episode_whose_worker_a_hung_call_took_down_goes_on_from_its_kept_instance(tok, monkeypatch):
    """A call that hangs past env.timeout_s gets its worker killed and replaced; the other episodes that worker held
    lost their instances with it. Each one with an instance kept after its last answer (what a checkpoint keeps) is
    rebuilt on a worker from it and its call asked again, counted in env/resumed, and runs all its turns; only the
    hung episodes end."""
    monkeypatch.setenv("SLOW_ENV_S", "0.2")  # (a slow tool: the hung episodes start while the others are mid-way)
    c, _, pool, rewards = controller(tok, [{"turns": 4}, {"turns": 3, "mode": "hang"}], env="helpers.envs:Slow")
    groups, _ = one_phase(c, pool, rewards)
    ok, hung = sorted(groups, key=lambda g: g.prompt_index)
    assert all(s.env_error.startswith("timeout") for s in hung.samples) and pool.timeouts == 2
    assert pool.lost >= 1  # (the premise: a hang took down a worker holding another episode)
    assert_whole_episodes(tok, [ok])  # every turn of the other episodes, none ended by the hang
    assert pool.resumed == pool.lost
