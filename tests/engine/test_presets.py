"""Every algorithm preset trains in the real loop (one short CPU run each, in one process).

The default run trains GRPO (with TIS and an entropy bonus) and PPO (critic, KL to the frozen reference, mini-batches
and epochs); the other presets run in the slow set, in one more worker."""

import pytest

from helpers.scripts import run_script
from megarl.config import load_config
from megarl.config.presets import PRESETS

FAST = ("grpo", "ppo")
SLOW = tuple(sorted(set(PRESETS) - set(FAST)))


def _train(tmp_path_factory, presets) -> dict:
    return run_script(["tests/workers/preset_checks.py", str(tmp_path_factory.mktemp("presets")), *presets],
                      timeout=1500)


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    return _train(tmp_path_factory, FAST)


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    return _train(tmp_path_factory, SLOW)


def _trains_in_the_loop(r: dict) -> None:
    assert r["finite"], r["steps"]
    assert r["moved"] > 0  # the policy's weights changed
    for m in r["steps"]:
        assert 0.0 <= m["reward/mean"] <= 1.0
        assert "rollout/bubble_ratio" in m


def _measures_the_mismatch(runs: dict) -> None:
    """``mismatch/kl`` every step that trains the policy: from the proximal forward (grpo: algo.tis=token; cispo:
    mask_token) or else from the first optimizer step's forward (ppo there is the first of 2 mini-batches × 2
    epochs)."""
    for preset, r in runs.items():
        for m in r["steps"]:
            if "loss/policy" in m:
                assert 0.0 <= m["mismatch/kl"] < 1e-3 and m["mismatch/nll"] > 0, preset  # fp32: a tiny gap


@pytest.mark.parametrize("preset", FAST)
def test_preset_trains_in_the_loop(fast, preset):
    _trains_in_the_loop(fast[preset])


@pytest.mark.slow
@pytest.mark.parametrize("preset", SLOW)
def test_other_presets_train_in_the_loop(slow, preset):
    _trains_in_the_loop(slow[preset])


def test_ppo_trains_the_critic_against_the_reference(fast):
    for m in fast["ppo"]["steps"]:
        assert m["critic/value_mse"] >= 0.0
    assert "loss/kl_ref" in fast["ppo"]["steps"][0]  # PPO's KL to the frozen reference


@pytest.mark.slow
def test_vapo_pretrains_its_critic(slow):
    for m in slow["vapo"]["steps"]:
        assert m["critic/value_mse"] >= 0.0
    vapo = slow["vapo"]["steps"]
    assert slow["vapo"]["cfg"]["critic_warmup_steps"] == 2
    assert "loss/policy" not in vapo[0] and "loss/policy" not in vapo[1]  # value pre-training: no policy loss
    v = slow["vapo"]["versions"]  # ... and no policy version: nothing moved, nothing to sync, nothing aged
    assert v[0] == v[1] == v[2] - 1 and "sync/bytes" not in vapo[0] and "sync/bytes" in vapo[2]
    assert "loss/clip_frac" in vapo[2]


def test_tis_and_entropy_report_their_metrics(fast):
    m = fast["grpo"]["steps"][0]
    assert 0.0 <= m["mismatch/abs_mean"] <= m["mismatch/abs_max"] < 1e-3  # same weights: tiny gap
    assert m["loss/entropy"] > 0


def test_every_policy_step_measures_the_mismatch(fast):
    _measures_the_mismatch(fast)


@pytest.mark.slow
def test_the_other_presets_measure_the_mismatch_and_the_mask_reports_what_it_dropped(slow):
    _measures_the_mismatch(slow)
    for m in slow["cispo"]["steps"]:
        assert m["mismatch/masked_token_frac"] == 0.0 == m["mismatch/masked_seq_frac"]  # nothing near the band's edges
    assert "mismatch/abs_max" not in slow["dapo"]["steps"][0]


@pytest.mark.slow
def test_dynamic_sampling_counts_filtered_groups(slow):
    assert all("rollout/groups_filtered" in m for m in slow["dapo"]["steps"])


def test_presets_apply_but_explicit_keys_win():
    cfg = load_config(None, ["algo.preset=dapo", "algo.clip_high=0.3"])
    assert cfg.algo.dynamic_sampling and cfg.algo.loss_agg == "token_mean"
    assert cfg.algo.clip_high == pytest.approx(0.3)
    assert load_config(None, ["algo.preset=gspo"]).algo.policy_loss == "gspo"
    with pytest.raises(ValueError, match="algo.preset 'nope' is not known"):
        load_config(None, ["algo.preset=nope"])
