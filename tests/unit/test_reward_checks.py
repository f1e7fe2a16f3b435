"""A reward that fails on every call must not train silently on zeros: its signature is checked against the
dataset's columns before launch, the first failure's traceback (file and line in the user's code) is logged once,
and ``failing_steps`` counts the steps in a row in which every training call failed (the loop stops at
``reward.max_failed_steps``; end to end in ``test_data_faults.py``)."""

import logging

import pytest

from megarl.rewards.base import check_reward_call
from megarl.rewards.pool import RewardPool


def test_signature_is_bound_to_the_rows_columns_before_launch():
    check_reward_call("helpers.reward_fns:with_extras", {"difficulty": 3, "source": "x"})
    check_reward_call("math", {"anything": 1})  # built-ins take any extras
    check_reward_call("", {})  # the built-in task's own reward
    with pytest.raises(ValueError, match=r"reward.fn='helpers.reward_fns:with_extras': def with_extras\(response: str, "
                                         r".*\(difficulty, level\): .*unexpected keyword argument 'level'"):
        check_reward_call("helpers.reward_fns:with_extras", {"difficulty": 3, "level": 1})
    with pytest.raises(ValueError, match=r"\(none\): missing a required argument: 'difficulty'"):
        check_reward_call("helpers.reward_fns:with_extras", {})
    with pytest.raises(ValueError, match=r"reward_fns .*reward_fns.py\) has no callable 'nope'; it has: .*with_extras"):
        check_reward_call("helpers.reward_fns:nope", {})


def test_first_failure_traceback_once_and_steps_of_only_failures_counted(caplog):
    pool = RewardPool("helpers.reward_fns:hang_or_raise", workers=1, timeout_s=20)
    try:
        with caplog.at_level(logging.WARNING, logger="megarl.rewards.pool"):
            assert pool.score([("boom", "x"), ("boom", "x")]) == [0.0, 0.0]
            assert pool.score([("boom", "x")]) == [0.0]
        tracebacks = [r.getMessage() for r in caplog.records if "Traceback" in r.getMessage()]
        assert len(tracebacks) == 1, tracebacks
        assert "reward_fns.py\", line" in tracebacks[0] and "in hang_or_raise" in tracebacks[0]
        assert "RuntimeError: a bad row" in tracebacks[0]
        assert pool.failing_steps() == 1  # the two calls above were one step: all failed
        pool.score([("boom", "x")])
        assert pool.failing_steps() == 2
        assert pool.failing_steps() == 2  # a step without reward calls changes nothing
        pool.score_detailed([("boom", "x")])  # an evaluation's calls do not count
        assert pool.failing_steps() == 2
        pool.score([("boom", "x"), ("y", "y")])  # one call succeeded: the run is not failing
        assert pool.failing_steps() == 0
    finally:
        pool.close()
