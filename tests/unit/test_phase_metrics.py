"""PhaseMetrics.summary (pure): the rates exist only for a phase that generated tokens."""

from collections import Counter

import pytest

from megarl.rollout.phase_metrics import PhaseMetrics


def test_rates_over_the_engine_time_of_a_generating_phase():
    m = PhaseMetrics(duration=2.0, tokens_generated=300, tokens_useful=100, samples_trained=4)
    s = m.summary()
    assert s["rollout/tokens_per_s"] == pytest.approx(150.0)
    assert s["rollout/useful_tokens_per_s"] == pytest.approx(50.0)


def test_a_phase_that_only_releases_buffered_groups_logs_no_rate():
    """Partial mode: groups held whole last phase are released without one engine step (duration 0);
    useful tokens / max(0, 1e-12) logged ~7e14 tokens/s. Such a phase has no rate: the keys are absent."""
    m = PhaseMetrics(duration=0.0, tokens_generated=0, tokens_useful=731, samples_trained=16, groups_trained=4,
                     staleness=Counter({1: 731}))
    s = m.summary()
    assert "rollout/useful_tokens_per_s" not in s and "rollout/tokens_per_s" not in s
    assert s["rollout/groups_released"] == 4.0 and s["rollout/staleness_mean"] == 1.0  # the rest is still there
    # merged over a generating phase (the simulator's and the bench's totals), the rate is over real time again
    total = PhaseMetrics(duration=5.0, tokens_generated=1000, tokens_useful=700)
    total.merge(m)
    assert total.summary()["rollout/useful_tokens_per_s"] == pytest.approx((700 + 731) / 5.0)
