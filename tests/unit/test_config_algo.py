"""``algo.*`` config: presets apply where they are given, and out-of-range or contradictory keys stop the run
before launch (megarl/config/presets.py, megarl/config/validate/algo.py). Pure config: fast."""

import dataclasses
import sys

import pytest

from helpers.scripts import ROOT
from megarl.config import ConfigError, load_config, validate
from megarl.config.presets import PRESETS
from megarl.models.tiny import TinyShape, hf_config


def say(text: str) -> None:  # what the CLI passes in the process that speaks for the job
    print(text, file=sys.stderr)

MOE = hf_config(TinyShape(family="qwen3_moe"), eos_id=1, pad_id=0)
DEMO = ROOT / "configs" / "demo.yaml"


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_preset_on_the_command_line_replaces_the_files_algo_keys(preset, capsys):
    """README: `megarl demo algo.preset=NAME` runs that preset although configs/demo.yaml sets GRPO's keys."""
    got = load_config(DEMO, [f"algo.preset={preset}"], say=say).algo
    assert dataclasses.asdict(got) == dataclasses.asdict(load_config(None, [f"algo.preset={preset}"]).algo)
    for key, value in PRESETS[preset].items():
        assert getattr(got, key) == value, key
    err = capsys.readouterr().err
    assert f"algo.preset={preset}" in err and f"algo.clip_high=0.28 ({DEMO})" in err  # says what it replaced
    validate(load_config(DEMO, [f"algo.preset={preset}"]), 1, MOE)


def test_preset_on_the_demo_runs_ppo_and_later_keys_win(capsys):
    a = load_config(DEMO, ["algo.preset=ppo"]).algo
    assert (a.advantage, a.whiten_advantages, a.kl_coef, a.clip_high) == ("gae", True, 0.001, 0.2)
    a = load_config(DEMO, ["algo.preset=ppo", "algo.clip_high=0.3"]).algo
    assert a.advantage == "gae" and a.clip_high == pytest.approx(0.3)
    a = load_config(DEMO, ["algo.clip_high=0.3", "algo.preset=ppo"], say=say).algo  # an earlier override too
    assert a.clip_high == pytest.approx(0.2)
    assert "algo.clip_high=0.3 (override 'algo.clip_high=0.3')" in capsys.readouterr().err


def test_keys_in_the_presets_own_layer_win(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("algo:\n  preset: dapo\n  clip_high: 0.3\n")
    a = load_config(path, ["algo.kl_coef=0.01"], say=say).algo
    assert a.dynamic_sampling and a.clip_high == pytest.approx(0.3) and a.kl_coef == pytest.approx(0.01)
    assert capsys.readouterr().err == ""  # nothing earlier was replaced
    with pytest.raises(ConfigError, match=r"override 'algo.preset=PPO': algo.preset 'PPO' is not known; valid: grpo"):
        load_config(path, ["algo.preset=PPO"])


def test_the_note_is_said_once_per_job_not_by_each_torchrun_worker(monkeypatch, capsys):
    """The CLI says the note in the process that speaks for the job (the launcher, or rank 0 of an srun/mpirun job),
    not again in each worker; ``load_config`` itself says nothing unless given ``say``."""
    from megarl.cli import main as cli_main

    load_config(DEMO, ["algo.preset=ppo"])
    assert capsys.readouterr().err == ""
    refused = ["train", "--config", str(DEMO), "algo.preset=ppo", "rollout.samples_per_prompt=1"]  # after the load
    assert cli_main(refused) == 2
    assert "algo.preset=ppo" in capsys.readouterr().err
    for key, value in {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    assert cli_main(refused) == 2
    err = capsys.readouterr().err
    assert "replaces the algo keys" not in err and "samples_per_prompt" in err


def test_ppo_value_targets_use_its_lambda():
    a = load_config(None, ["algo.preset=ppo"]).algo
    assert a.lam == a.lam_critic == pytest.approx(0.95)
    assert load_config(None, ["algo.preset=vapo"]).algo.lam_critic == 1.0  # VAPO's decoupled λ


@pytest.mark.parametrize("overrides, message", [
    (["algo.kl_coef=-0.1"], r"algo.kl_coef must be >= 0 .*got -0.1"),
    # the reviewed pitfalls: a ratio biased by the sampler's nucleus, a KL term with no expected gradient
    (["rollout.top_p=0.95"], r"rollout.top_p=0.95 with algo.tis=none: .*nucleus.*Set rollout.top_p=1"),
    (["algo.preset=gspo", "rollout.top_p=0.9"], r"rollout.top_p=0.9 with algo.tis=none"),
    (["algo.kl_coef=0.01", "algo.kl_estimator=k1"], r"algo.kl_estimator=k1 .*zero expected gradient.*Use k2"),
    (["algo.entropy_coef=-0.01"], r"algo.entropy_coef must be >= 0 .*got -0.01"),
    (["algo.critic_lr=-1"], r"algo.critic_lr must be > 0 .*got -1"),
    (["algo.critic_lr=0"], r"algo.critic_lr must be > 0"),
    (["algo.gamma=2"], r"algo.gamma must be in \[0, 1\].*got 2"),
    (["algo.lam=1.5"], r"algo.lam must be in \[0, 1\].*got 1.5"),
    (["algo.lam_critic=-0.1"], r"algo.lam_critic must be in \[0, 1\]"),
    (["algo.lam=.nan"], r"algo.lam must be in \[0, 1\]"),
    (["algo.preset=dapo", "algo.oversample_cap=0"],
     r"algo.oversample_cap must be >= 1 with algo.dynamic_sampling.*got 0"),
    (["algo.dynamic_sampling=true", "algo.oversample_cap=0.5"], r"algo.oversample_cap must be >= 1"),
    (["algo.overlong_cache=-5"], r"algo.overlong_cache must be >= 0 .*got -5"),
    (["algo.overlong_cache_frac=1"], r"algo.overlong_cache_frac must be in \[0, 1\) .*got 1"),
    (["algo.overlong_cache_frac=0.99", "rollout.max_new_tokens=20"],
     r"algo.overlong_cache_frac=0.99 of rollout.max_new_tokens \(20\) leaves no response length unpenalised"),
    (["algo.loss_norm_tokens=-3"], r"algo.loss_norm_tokens must be >= 0 .*got -3"),
    (["algo.value_clip=-1"], r"algo.value_clip must be >= 0 .*got -1"),
    (["algo.clip_low=1.5"], r"algo.clip_low must be in \[0, 1\) .*got 1.5"),
    (["algo.clip_low=1"], r"algo.clip_low must be in \[0, 1\)"),
    (["algo.clip_high=-0.1"], r"algo.clip_high must be >= 0"),
    (["algo.positive_nll_coef=-1"], r"algo.positive_nll_coef must be >= 0"),
    (["algo.length_adaptive_alpha=-1"], r"algo.length_adaptive_alpha must be >= 0"),
    (["algo.overlong_penalty=-1"], r"algo.overlong_penalty must be >= 0"),
    (["algo.curriculum_eps=0"], r"algo.curriculum_eps must be > 0"),
    (["algo.preset=vapo", "train.steps=2"], r"algo.critic_warmup_steps=2 must be < train.steps \(2\)"),
    (["algo.advantage=gae", "algo.critic_warmup_steps=20"],
     r"algo.critic_warmup_steps=20 must be < train.steps \(20\)"),
    (["algo.advantage=grpo", "algo.critic_warmup_steps=2"],
     r"algo.critic_warmup_steps=2 with algo.advantage=grpo \(a group advantage: no critic is built.*skip the policy"),
    (["algo.advantage=rloo", "algo.whiten_advantages=true"], r"algo.whiten_advantages=true with algo.advantage=rloo"),
    (["algo.length_adaptive_alpha=0.05"], r"algo.length_adaptive_alpha=0.05 with algo.advantage=grpo"),
    (["algo.lam=0.9", "algo.critic_lr=0.01"],
     r"algo.lam=0.9, algo.critic_lr=0.01 with algo.advantage=grpo .*would be ignored"),
    (["algo.preset=ppo", "algo.advantage=dr_grpo", "algo.whiten_advantages=false"],
     r"algo.lam_critic=0.95 \(from algo.preset=ppo\).* with algo.advantage=dr_grpo"),
    (["algo.policy_loss=gspo", "algo.dual_clip=3"], r"algo.dual_clip=3.0 does not apply with algo.policy_loss=gspo"),
    (["algo.preset=gspo", "algo.dual_clip=3"], r"algo.dual_clip.*algo.policy_loss=gspo"),
    (["algo.preset=cispo", "algo.dual_clip=3"], r"algo.dual_clip=3.0 does not apply with algo.policy_loss=cispo"),
    (["algo.policy_loss=cispo", "algo.clip_low=1.5"], r"algo.clip_low must be in \[0, 1\] with algo.policy_loss=cispo"),
    (["algo.preset=cispo", "algo.policy_loss=ppo"], r"algo.clip_low must be in \[0, 1\) .*got 1.0"),
    # the mismatch mask's band must hold ρ = 1 (lower ≥ upper, negative and 1-excluding bands refused by key)
    (["algo.tis=mask_token", "algo.mask_low=-0.1"], r"algo.mask_low must be in \[0, 1\) .*got -0.1"),
    (["algo.tis=mask_token", "algo.mask_low=1"], r"algo.mask_low must be in \[0, 1\)"),
    (["algo.tis=mask_sequence", "algo.mask_low=0.9", "algo.mask_high=0.8"], r"algo.mask_high must be > 1 .*got 0.8"),
    (["algo.tis=mask_token", "algo.mask_high=-2"], r"algo.mask_high must be > 1"),
    (["algo.mask_high=.nan"], r"algo.mask_high must be > 1"),
])
def test_out_of_range_or_contradictory_algo_keys_are_refused_before_launch(overrides, message):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 1, MOE)


@pytest.mark.parametrize("overrides", [
    [], ["algo.preset=ppo"], ["algo.preset=vapo"], ["algo.preset=dapo", "algo.oversample_cap=1"],
    ["algo.preset=gspo", "algo.tis=token"], ["algo.oversample_cap=0"],  # no dynamic sampling: the cap is unused
    ["rollout.top_p=0.9", "algo.tis=sequence"], ["algo.kl_estimator=k1", "algo.kl_coef=0"],
    ["algo.advantage=gae", "algo.kl_coef=0", "algo.entropy_coef=0", "algo.value_clip=0", "algo.gamma=0", "algo.lam=1",
     "algo.clip_low=0"],
    ["algo.preset=cispo"], ["algo.policy_loss=cispo"], ["algo.preset=cispo", "algo.tis=mask_token"],
    ["algo.tis=mask_token", "algo.mask_low=0", "algo.mask_high=5"],
    ["algo.tis=mask_sequence", "algo.mask_low=0.999", "algo.mask_high=1.001"],
    ["rollout.top_p=0.9", "algo.tis=mask_token"],
])
def test_defaults_presets_and_edges_validate(overrides):
    validate(load_config(None, overrides), 1, MOE)


STALE = {  # every way a run trains tokens sampled by older weights
    "one_step": ["rollout.overlap=one_step"],
    "async k=1": ["rollout.overlap=async", "rollout.staleness_limit=1"],
    "async k=3": ["rollout.overlap=async", "rollout.staleness_limit=3"],
    "partial k=1": ["rollout.mode=partial", "rollout.staleness_limit=1"],
}
FRESH = {"sync": [], "async k=0": ["rollout.overlap=async", "rollout.staleness_limit=0"],
         "partial k=0": ["rollout.mode=partial", "rollout.staleness_limit=0"], "on_policy": ["rollout.mode=on_policy"]}
CORRECTED = [["algo.tis=token"], ["algo.tis=sequence"], ["algo.tis=mask_token"], ["algo.tis=mask_sequence"],
             ["algo.decoupled_ppo=true"], ["algo.preset=cispo"], ["algo.policy_loss=cispo"]]


def _notes(*overrides):
    from megarl.config.validate.algo import algo_notes

    cfg = load_config(None, ["engine.placement=disaggregated", *overrides])
    validate(cfg, 1, MOE)  # (a note, not an error: the run is valid)
    return algo_notes(cfg)


@pytest.mark.parametrize("stale", sorted(STALE))
@pytest.mark.parametrize("loss", [[], ["algo.preset=gspo"]])
def test_stale_data_without_an_off_policy_correction_is_noted(stale, loss):
    """One-step and async overlap, partial rollouts: at every k ≥ 1, not only past AReaL's staleness 2 (the default
    corrects them: only a run that turns the decoupled objective off meets the note)."""
    assert _notes(*STALE[stale], *loss) == []
    (note,) = _notes(*STALE[stale], *loss, "algo.decoupled_ppo=false")
    assert stale.split()[0] in note and "no off-policy correction" in note
    assert "algo.decoupled_ppo=false turns off" in note and "algo.tis=token|sequence|mask_token|mask_sequence" in note
    assert "algo.policy_loss=cispo" in note
    assert ("beyond staleness 2" in note) == (stale == "async k=3")


@pytest.mark.parametrize("stale", sorted(STALE))
@pytest.mark.parametrize("correction", CORRECTED, ids=lambda c: " ".join(c))
def test_stale_data_with_an_off_policy_correction_is_not_noted(stale, correction):
    assert _notes(*STALE[stale], *correction) == []


@pytest.mark.parametrize("fresh", sorted(FRESH))
def test_fresh_data_is_not_noted(fresh):
    assert _notes(*FRESH[fresh]) == []


def test_the_decoupled_objective_is_on_by_default_where_the_data_is_stale():
    """AReaL's decoupled PPO under one_step, async and partial rollouts at k ≥ 1; off on fresh data (it costs a
    forward over the batch there for nothing) and where algo.tis or CISPO already corrects; an explicit value wins."""
    from megarl.config.validate.algo import resolved_decoupled_ppo

    def resolved(*overrides):
        return resolved_decoupled_ppo(load_config(None, ["engine.placement=disaggregated", *overrides]))

    assert all(resolved(*STALE[k]) for k in STALE)
    assert not any(resolved(*FRESH[k]) for k in FRESH)
    for other in (["algo.tis=token"], ["algo.tis=mask_sequence"], ["algo.policy_loss=cispo"]):
        assert not resolved("rollout.overlap=one_step", *other)
    assert not resolved("rollout.overlap=one_step", "algo.decoupled_ppo=false")
    assert resolved("algo.decoupled_ppo=true")  # (fresh data: the user's choice)


def test_the_stale_data_note_is_said_before_launch(tmp_path, capsys):
    from megarl.config.validate.prelaunch import checked_config

    run = [f"train.run_dir={tmp_path}", f"model.path={tmp_path / 'model'}", "model.make_tiny=qwen3_moe",
           "engine.placement=disaggregated", "rollout.overlap=one_step"]
    checked_config(None, [*run, "algo.decoupled_ppo=false"], 1, command="plan")
    assert "megarl: note: rollout.overlap=one_step trains every batch 1 version after" in capsys.readouterr().err
    checked_config(None, run, 1, command="plan")
    assert "off-policy" not in capsys.readouterr().err
    checked_config(None, [*run, "algo.tis=mask_token"], 1, command="plan")
    assert "off-policy" not in capsys.readouterr().err
