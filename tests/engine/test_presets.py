"""Every algorithm preset trains in the real loop (one short CPU run each, in one process)."""

import pytest

from helpers.scripts import run_script
from megarl.config import load_config
from megarl.config.presets import PRESETS


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_script(["tests/workers/preset_checks.py", str(tmp_path_factory.mktemp("presets"))], timeout=1500)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_trains_in_the_loop(runs, preset):
    r = runs[preset]
    assert r["finite"], r["steps"]
    assert r["moved"] > 0  # the policy's weights changed
    for m in r["steps"]:
        assert 0.0 <= m["reward/mean"] <= 1.0
        assert "rollout/bubble_ratio" in m


def test_critic_presets_train_the_critic_and_vapo_pretrains_it(runs):
    for preset in ("ppo", "vapo"):
        for m in runs[preset]["steps"]:
            assert m["critic/value_mse"] >= 0.0
    vapo = runs["vapo"]["steps"]
    assert runs["vapo"]["cfg"]["critic_warmup_steps"] == 2
    assert "loss/policy" not in vapo[0] and "loss/policy" not in vapo[1]  # value pre-training: no policy loss
    v = runs["vapo"]["versions"]  # ... and no policy version: nothing moved, nothing to sync, nothing aged
    assert v[0] == v[1] == v[2] - 1 and "sync/bytes" not in vapo[0] and "sync/bytes" in vapo[2]
    assert "loss/clip_frac" in vapo[2]
    assert "loss/kl_ref" in runs["ppo"]["steps"][0]  # PPO's KL to the frozen reference


def test_tis_and_entropy_report_their_metrics(runs):
    m = runs["grpo"]["steps"][0]
    assert 0.0 <= m["mismatch/abs_mean"] <= m["mismatch/abs_max"] < 1e-3  # same weights: tiny gap
    assert m["loss/entropy"] > 0


def test_every_policy_step_measures_the_mismatch_and_the_mask_reports_what_it_dropped(runs):
    """``mismatch/kl`` every step that trains the policy: from the proximal forward (grpo: algo.tis=token; cispo:
    mask_token) or else from the first optimizer step's forward (ppo there is the first of 2 mini-batches × 2
    epochs)."""
    for preset, r in runs.items():
        for m in r["steps"]:
            if "loss/policy" in m:
                assert 0.0 <= m["mismatch/kl"] < 1e-3 and m["mismatch/nll"] > 0, preset  # fp32: a tiny gap
    for m in runs["cispo"]["steps"]:
        assert m["mismatch/masked_token_frac"] == 0.0 == m["mismatch/masked_seq_frac"]  # nothing near the band's edges
    assert "mismatch/abs_max" in runs["grpo"]["steps"][0] and "mismatch/abs_max" not in runs["dapo"]["steps"][0]


def test_dynamic_sampling_counts_filtered_groups(runs):
    assert all("rollout/groups_filtered" in m for m in runs["dapo"]["steps"])


def test_presets_apply_but_explicit_keys_win():
    cfg = load_config(None, ["algo.preset=dapo", "algo.clip_high=0.3"])
    assert cfg.algo.dynamic_sampling and cfg.algo.loss_agg == "token_mean"
    assert cfg.algo.clip_high == pytest.approx(0.3)
    assert load_config(None, ["algo.preset=gspo"]).algo.policy_loss == "gspo"
    with pytest.raises(ValueError, match="algo.preset 'nope' is not known"):
        load_config(None, ["algo.preset=nope"])
