"""The update-batch contract with the real vLLM engine inside the real RL loop (one subprocess)."""

import pytest

from conftest import run_script


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    return run_script(["tests/rollout_loop_checks.py", str(tmp_path_factory.mktemp("loop"))])


@pytest.mark.parametrize("mode", ["sync", "on_policy", "partial"])
def test_each_step_trains_exactly_prompts_per_step_groups(loop, mode):
    for m in loop[mode]:
        assert m["rollout/groups_released"] == 3, loop[mode]
        assert 0.0 <= m["rollout/bubble_ratio"] <= 1.0
        if mode != "partial":
            assert m["rollout/staleness_max"] == 0
        else:
            assert m["rollout/staleness_max"] <= 2


def test_groups_released_reaches_tensorboard(loop):
    assert loop["tb_groups_released"] == [3.0] * 9


def test_the_bound_was_exercised(loop):
    """Groups completed past the update batch (held or discarded) instead of enlarging it."""
    assert sum(m["rollout/groups_over_bound"] for mode in ("on_policy", "partial") for m in loop[mode]) >= 1
