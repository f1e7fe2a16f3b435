"""The update-batch contract with the real vLLM engine inside the real RL loop (one subprocess)."""

import pytest

from helpers.scripts import run_script


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    return run_script(["tests/workers/rollout_loop_checks.py", str(tmp_path_factory.mktemp("loop"))])


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


def test_a_step_without_an_update_keeps_the_policy_version(loop):
    """A step whose groups were all filtered (dynamic sampling at its cap) trains nothing: the version the
    engines serve and staleness is counted against stays (it counted steps: the next on-policy phase's tokens
    showed staleness 1, and partial mode expired held samples the policy had not moved away from). That last step
    runs with a tokenizer without a pad token (Llama-3, Mistral): its update failed on pad_token_id None."""
    skip = loop["skip"]
    assert skip["skipped_released"] == 0
    first = skip["versions"][0]
    assert first == 9 and skip["versions"] == [first, first, first + 1] and skip["engine_version"] == first + 1
    assert skip["after"]["rollout/groups_released"] == 3 and skip["after"]["rollout/staleness_max"] == 0
