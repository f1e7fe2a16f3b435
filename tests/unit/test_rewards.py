"""Rewards: math-verify equivalences, built-ins, user functions by dotted path, the sandboxed pool."""

import time

import pytest

from helpers.processes import ended_or_killed
from megarl.rewards.base import resolve_reward
from megarl.rewards.builtin import exact_reward, last_boxed, math_reward
from megarl.rewards.pool import RewardPool

pytestmark = pytest.mark.alone  # hanging rewards cut at their timeout, timed: never beside another test (make test)

EQUIVALENT = [
    (r"\frac{1}{2}", r"so the answer is \boxed{0.5}"),
    (r"\frac{1}{2}", r"The answer is $1/2$."),
    ("0.5", r"\boxed{\frac12}"),
    (r"\{1, 2\}", r"\boxed{\{2,1\}}"),
    (r"(1, 3]", r"\boxed{(1,3]}"),
    (r"\sqrt{2}", r"\boxed{2^{1/2}}"),
    ("6", r"first \boxed{5}, no wait: \boxed{6}"),
    (r"\frac{3}{4}", r"\boxed{\dfrac{3}{4}}"),
    ("-2", r"\boxed{-2}"),
]
NOT_EQUIVALENT = [
    (r"\frac{1}{2}", r"\boxed{\frac{1}{3}}"),
    ("3", r"\boxed{4}"),
    (r"(1, 3]", r"\boxed{[1,3]}"),
    (r"\{1, 2\}", r"\boxed{\{1,2,3\}}"),
    ("6", r"\boxed{6} is wrong, it is \boxed{5}"),
    ("7", "I do not know"),
]


@pytest.mark.parametrize("answer,response", EQUIVALENT)
def test_math_reward_accepts_equivalent_answers(answer, response):
    assert math_reward(response, answer) == 1.0


@pytest.mark.parametrize("answer,response", NOT_EQUIVALENT)
def test_math_reward_rejects_different_answers(answer, response):
    assert math_reward(response, answer) == 0.0


def test_exact_reward_and_boxed_extraction():
    assert last_boxed(r"a \boxed{\frac{1}{2}} b \boxed{x^{2}}") == "x^{2}"
    assert last_boxed(r"\boxed{unclosed") is None
    assert exact_reward(r"so \boxed{42}", "42") == 1.0
    assert exact_reward(" 42\n", "42") == 1.0
    assert exact_reward(r"\boxed{42.0}", "42") == 0.0


def test_format_coef_on_builtins_and_refused_for_user_functions():
    fn = resolve_reward("math", format_coef=0.1)
    assert fn(r"\boxed{2}", "2") == {"score": 1.1, "format": 1.0, "correct": 1.0}
    assert fn("2", "2") == {"score": 0.9, "format": 0.0, "correct": 1.0}
    with pytest.raises(ValueError, match="format_coef"):
        resolve_reward("helpers.reward_fns:with_extras", format_coef=0.1)


def test_user_reward_by_dotted_path_gets_row_extras_and_dict_metrics():
    pool = RewardPool("helpers.reward_fns:with_extras", workers=1, timeout_s=20)
    try:
        scores = pool.score([("42", "42", {"difficulty": 3, "source": "olympiad"}),
                             ("a long wrong answer", "42", {"difficulty": 5})])
        assert scores == [2.0, 0.0]
        m = pool.step_metrics()
        assert m["reward/difficulty"] == 4.0 and m["reward/long"] == 0.5 and m["reward/errors"] == 0.0
        assert m["reward/scored_mean"] == 1.0 and m["timing/reward_s"] > 0  # every sample scored, and its time
        again = pool.step_metrics()
        assert "reward/difficulty" not in again and "reward/scored_mean" not in again  # per step
        assert again["timing/reward_s"] == 0.0
        # an evaluation's calls (score_detailed) count in the cumulative figures, not in the next step's
        pool.score_detailed([("42", "42", {"difficulty": 9}), ("x", "42", {"difficulty": 9})])
        pool.score([("42", "42", {"difficulty": 1})])
        m = pool.step_metrics()
        assert m["reward/difficulty"] == 1.0 and pool.calls == 5 and m["reward/scored_mean"] == 1.0  # (not the eval's)
    finally:
        pool.close()


def test_a_reward_that_names_finish_reason_sees_whether_the_sample_was_cut():
    from megarl.rewards.base import check_reward_call

    check_reward_call("helpers.reward_fns:overlong_penalty", {})  # finish_reason is given, not a row column
    pool = RewardPool("helpers.reward_fns:overlong_penalty", workers=1, timeout_s=20)
    try:
        assert pool.score([("42", "42", {}, "stop"), ("42", "42", {}, "length"), ("41", "42", {}, "stop")]) == [
            1.0, -1.0, 0.0]
    finally:
        pool.close()
    pool = RewardPool("helpers.reward_fns:with_extras", workers=1, timeout_s=20)
    try:  # a function that does not name it is called as before
        assert pool.score([("42", "42", {"difficulty": 1}, "length")]) == [1.0]
    finally:
        pool.close()
    from megarl.models.tiny import build_tokenizer
    from megarl.rollout.scoring import group_scorer
    from megarl.types import Group, Sample

    tok = build_tokenizer()
    samples = [Sample([1, 2], tok("42", add_special_tokens=False)["input_ids"]) for _ in range(2)]
    samples[0].finish_reason, samples[1].finish_reason = "stop", "length"
    pool = RewardPool("helpers.reward_fns:overlong_penalty", workers=1, timeout_s=20)
    try:  # a released group's samples carry theirs to the reward
        group_scorer(tok, pool)(Group(0, "q", "42", samples))
        assert [s.reward for s in samples] == [1.0, -1.0]
    finally:
        pool.close()


def test_bad_reward_fn_is_a_clear_error_before_scoring():
    for spec, words in (("helpers.reward_fns:nope", "no callable 'nope'"), ("no_such_mod:f", "cannot import"),
                        ("mathh", "built-in"),
                        ("myrewards/verifiers.py:good", r"is a file path; .*: reward.fn=myrewards.verifiers:good")):
        with pytest.raises(ValueError, match=words):
            RewardPool(spec, workers=1)


def test_hangs_and_errors_are_contained_counted_and_do_not_slow_later_scoring():
    """A reward that sleeps forever on some inputs and one that raises: the run goes on, counters are
    right, and scoring after 20 hangs is as fast as before (each hung worker was killed and replaced)."""
    pool = RewardPool("helpers.reward_fns:hang_or_raise", workers=2, timeout_s=0.5, on_error=-1.0)
    try:
        clean = [(str(i), str(i if i % 2 else i + 1), {}) for i in range(40)]
        t0 = time.time()
        assert pool.score(clean) == [0.0 if i % 2 == 0 else 1.0 for i in range(40)]
        before = time.time() - t0
        mixed = [("hang", "x"), ("boom", "x"), ("1", "1"), ("exit", "x"), ("not", "x")]
        assert pool.score(mixed) == [-1.0, -1.0, 1.0, -1.0, 0.0]
        m = pool.step_metrics()
        assert (m["reward/errors"], m["reward/timeouts"], m["reward/errors_step"]) == (2.0, 1.0, 2.0)
        t1 = time.time()
        assert pool.score([("hang", "x")] * 20) == [-1.0] * 20
        assert time.time() - t1 < 20 * 0.5 / 2 + 30  # hangs run side by side, each cut at the timeout
        assert pool.step_metrics()["reward/timeouts_step"] == 20.0
        time.sleep(3)  # replacements finish starting
        t2 = time.time()
        assert pool.score(clean) == [0.0 if i % 2 == 0 else 1.0 for i in range(40)]
        after = time.time() - t2
        assert after < 3 * before + 0.5, (before, after)
        assert (pool.errors, pool.timeouts, pool.calls) == (2, 21, 105)
        assert len([w for w in pool._workers if w.alive()]) == 2
    finally:
        pool.close()


def test_not_a_number_scores_on_error_and_counter_state_round_trips():
    pool = RewardPool("helpers.reward_fns:not_a_number", workers=1, timeout_s=10, on_error=0.25)
    try:
        assert pool.score([("a", "b")]) == [0.25]
        state = pool.state_dict()
        assert state == {"calls": 1, "errors": 1, "timeouts": 0}
    finally:
        pool.close()
    other = RewardPool("exact", workers=1)
    try:
        other.load_state_dict(state)
        assert other.step_metrics()["reward/errors"] == 1.0 and other.state_dict() == state
    finally:
        other.close()


def test_workers_exit_when_the_run_is_killed_mid_call(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "hang.py"
    script.write_text("import sys\nfrom megarl.rewards.pool import RewardPool\n"
                      "p = RewardPool('helpers.reward_fns:hang_or_raise', workers=1, timeout_s=600)\n"
                      "print(p._workers[0].proc.pid, flush=True)\np.score([('hang', 'x')])\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # (tests/ is on it: helpers.reward_fns)
    run = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    worker = int(run.stdout.readline())
    time.sleep(1)
    run.send_signal(signal.SIGKILL)
    run.wait()
    if not ended_or_killed(worker, 10.0):
        raise AssertionError("the hung reward worker outlived its killed parent")


def test_row_extras_travel_from_the_dataset_to_the_reward_of_a_released_group(tmp_path):
    """data source → controller PromptItem → (checkpoint, resume) → released Group → user reward with the row's
    columns. Two rows with the same prompt text in flight keep their own extras whichever finishes first (they were
    matched by text, first in first out: the later row's group, finishing first, got the other's)."""
    import json
    import pickle

    from megarl.data.chat import PromptRenderer
    from megarl.data.readers import RowStore
    from megarl.data.source import DatasetSource
    from megarl.models.tiny import build_tokenizer
    from megarl.rollout.scoring import PromptFeed, group_scorer
    from megarl.types import Group, Sample

    tok = build_tokenizer()
    rows = [{"prompt": "q1", "answer": "42", "difficulty": 3, "source": "olympiad"},
            {"prompt": "q2", "answer": "7", "difficulty": 1},
            {"prompt": "q1", "answer": "42", "difficulty": 5}]  # the same text as row 1, other columns
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    feed = PromptFeed(DatasetSource(RowStore(str(tmp_path / "d.jsonl")), PromptRenderer(tok), shuffle=False))
    items = pickle.loads(pickle.dumps([feed(), feed(), feed()]))  # in flight, in the controller's checkpoint
    resumed = PromptFeed(DatasetSource(RowStore(str(tmp_path / "d.jsonl")), PromptRenderer(tok), shuffle=False))
    resumed.load_state_dict(json.loads(json.dumps(feed.state_dict())))
    assert resumed().prompt_text == feed().prompt_text  # the cursor round-trips through the checkpoint
    pool = RewardPool("helpers.reward_fns:with_extras", workers=1, timeout_s=20)
    try:
        score = group_scorer(tok, pool)
        groups = [Group(it.index, it.prompt_text, it.answer,
                        [Sample(it.prompt_ids, tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
                         for text in (it.answer, "wrong")], it.extras) for it in items]
        for g in reversed(groups):  # released in another order than drawn
            score(g)
        assert [[s.reward for s in g.samples] for g in groups] == [[2.0, 0.0], [1.0, 0.0], [1.0, 0.0]]  # olympiad ×2
        assert groups[0].samples[0].text == "42"  # decoded without EOS
        assert pool.step_metrics()["reward/difficulty"] == 3.0  # (3 + 3 + 1 + 1 + 5 + 5) / 6
    finally:
        pool.close()
