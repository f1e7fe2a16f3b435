"""The simulator's model of generation beside training (``rollout.overlap``): timelines by hand, where the engines'
time goes, and the tool's report."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.rollout.controller import ControllerConfig, PromptItem, RolloutController
from megarl.rollout.phase import Phase
from megarl.rollout.sim.engines import SimulatedEngine, StepTimeModel
from megarl.rollout.sim.simulator import Pipeline, SimSettings, TrainerModel, overlap_timeline, simulate, with_trainer

TOOL = Path(__file__).resolve().parents[2] / "tools/simulate_rollout.py"

GEN, TRAIN, SYNC = [2.0, 3.0, 1.0], [4.0, 1.0, 2.0], 0.5


def _timeline(overlap, k=1):
    p = overlap_timeline(GEN, TRAIN, SYNC, overlap, k)
    return p.wall(), p.starts, p.ends


def test_none_takes_turns():
    assert _timeline("none") == (14.5, [0.0, 6.5, 11.0], [2.0, 9.5, 12.0])


def test_one_step_generates_the_next_batch_while_this_one_trains():
    # phase 1 runs during step 0 (max(train 4, gen 3) + sync), phase 2 during step 1, step 2 trains alone
    assert _timeline("one_step") == (10.5, [0.0, 2.0, 6.5], [2.0, 5.0, 7.5])


@pytest.mark.parametrize("k, wall, starts", [
    (0, 14.5, [0.0, 6.5, 11.0]),  # every phase waits until the step before it is synced: none's timeline
    (1, 10.5, [0.0, 2.0, 6.5]),  # phase 2 waits until step 0 is synced (6.5), not only until phase 1 ends (5.0)
    (2, 10.5, [0.0, 2.0, 5.0]),  # no wait, yet the same wall: the trainer is the bottleneck
])
def test_async_starts_a_phase_only_within_the_staleness_bound(k, wall, starts):
    got_wall, got_starts, ends = _timeline("async", k)
    assert (got_wall, got_starts) == (wall, starts)
    assert ends == [s + g for s, g in zip(starts, GEN)]  # no sync lands inside these phases


def test_async_engines_load_the_weights_of_each_step_as_it_is_done():
    p = Pipeline("async", SYNC, 2)
    for gen, train in zip(GEN[:2], TRAIN[:2]):
        p.begin()
        p.end(gen, train)
    assert p.begin() == 5.0 and p.done == [6.5, 8.0]  # phase 2 starts with v0; steps 0 and 1 land during it
    assert [p.version_at(t) for t in (5.0, 6.49, 6.5, 7.9, 8.0)] == [0, 0, 1, 1, 2]
    p.end(4.0, 2.0)  # 4 s of generation: both loads land inside it, each stops the engines for the sync
    assert (p.loads, p.ends[-1]) == ([0, 0, 2], 10.0)


def test_one_step_samples_one_version_behind():
    p = Pipeline("one_step", SYNC)
    versions = []
    for gen, train in zip(GEN, TRAIN):
        p.begin()
        versions.append(p.version_at(0.0))
        p.end(gen, train)
    assert versions == [0, 0, 1]


def _partial(steps=6, k=2, mode="partial", trainer=None):
    rng = random.Random(0)
    lengths = [rng.choice([20, 40, 80, 400]) + rng.randint(0, 9) for _ in range(8 * 64)]
    s = SimSettings(group_size=8, engines=2, slots=16, prompts_per_step=4, max_tokens=300, steps=steps,
                    staleness_limit=k)
    return simulate(lengths, mode, s, trainer)


@pytest.mark.parametrize("trainer_speed", [0.3, 1.0, 3.0])  # training time / generation time
def test_overlap_adds_staleness_that_the_bound_then_meets(trainer_speed):
    plain = _partial(steps=12)
    per_token = trainer_speed * sum(plain["phase_s_exact"]) / sum(plain["phase_trained_tokens"])
    one_step, overlapped = (_partial(steps=12, trainer=TrainerModel(o, per_token, 0.1)) for o in ("one_step", "async"))
    for out in (one_step, overlapped):
        assert out["staleness_mean"] > plain["staleness_mean"]  # tokens sampled with older weights than without overlap
        assert out["staleness_max"] <= 2  # still within k at training (at 3.0 a phase starting on the very moment
        # a step was synced once sampled with the weights before it: wall time from engine time, rounded down)
    if trainer_speed != 1.0:
        return
    sync_one_step = _partial(steps=4, mode="sync", trainer=TrainerModel("one_step", per_token, 0.1))
    tokens = sync_one_step["phase_trained_tokens"]  # phase 0 samples with v0, phases 1-3 one version behind
    assert sync_one_step["staleness_max"] == 1
    assert sync_one_step["staleness_mean"] == pytest.approx(sum(tokens[1:]) / sum(tokens))
    with pytest.raises(ValueError, match="timed as \\('one_step'"):  # a run times only under its own trainer
        with_trainer(overlapped, "one_step", per_token, 0.1, 2)
    with pytest.raises(ValueError, match="simulate it with TrainerModel"):  # not timed after the fact
        with_trainer(plain, "async", per_token, 0.1, 2)


def _live_peaks(lag: int, lengths: list[int]) -> tuple[int, RolloutController]:
    """Three partial phases (k 2, U 4, rollout_groups 8) with the engines ``lag`` versions behind each phase's batch:
    the most groups live or released in one phase, and the controller after them."""
    cfg = ControllerConfig(mode="partial", group_size=8, update_groups=4, rollout_groups=8, max_tokens=300,
                           staleness_limit=2)
    engines = [SimulatedEngine(16, lambda key: lengths[(key[0] % 64) * 8 + key[1]], StepTimeModel(), 32)
               for _ in range(2)]
    items = iter(range(10 ** 6))
    peak, before, served = [0], [0], [0]
    ctrl = RolloutController(cfg, engines, lambda: PromptItem(next(items), [1]),
                             on_engine_step=lambda *_: peak.append(len(ctrl.live) + len(ctrl.released) - before[0]),
                             engine_version=lambda _t: served[0])
    for version in (3, 4, 5):  # (earlier phases, at the same lag, leave live groups as a run would)
        served[0] = version - lag
        before[0] = len(ctrl.released)
        groups, _ = ctrl.run_phase(version)
        assert len(groups) == 4
    return max(peak), ctrl


def test_admission_starts_no_more_than_the_bound_lets_train(monkeypatch):
    """Partial under overlap: with the engines ``lag`` versions behind a phase's batch, no more groups live than
    the k − lag + 1 batches a sample started now can still reach, (k − lag + 1)·U; so at the bound nothing is carried
    over to go stale. The waste this saves, with the trainer 3× slower than generation (the engines at the bound)."""
    rng = random.Random(1)
    lengths = [rng.choice([20, 40, 80, 400]) + rng.randint(0, 9) for _ in range(8 * 64)]
    peak, ctrl = _live_peaks(2, lengths)
    assert peak <= 4 and not ctrl.live  # at the bound: only this batch's groups ran, all released
    assert _live_peaks(1, lengths)[0] <= 8
    # no bound at lag 0: free slots filled past rollout_groups, as without overlap
    assert _live_peaks(0, lengths)[0] > 8
    plain = _partial(steps=12)
    per_token = 3 * sum(plain["phase_s_exact"]) / sum(plain["phase_trained_tokens"])
    ruled = _partial(steps=12, trainer=TrainerModel("async", per_token, 0.1))
    monkeypatch.setattr(Phase, "room", lambda self: float("inf"))
    unruled = _partial(steps=12, trainer=TrainerModel("async", per_token, 0.1))
    assert ruled["staleness_max"] <= 2 and unruled["staleness_max"] <= 2
    assert ruled["wasted_token_fraction"] < 0.5 * unruled["wasted_token_fraction"]


@pytest.mark.parametrize("overlap", ["none", "one_step", "async"])
def test_engine_time_is_accounted_for(overlap):
    out = _partial()
    per_token = sum(out["phase_s_exact"]) / sum(out["phase_trained_tokens"])  # training as long as generation
    if overlap != "none":
        out = _partial(trainer=TrainerModel(overlap, per_token, 1.0))
    line = with_trainer(out, overlap, per_token, 1.0, 2)
    shares = [line[k] for k in line if k.startswith("engine_idle_")]
    assert len(shares) == 4 and min(shares) >= 0
    assert line["engine_utilisation"] + sum(shares) == pytest.approx(1.0)
    assert line["engine_utilisation"] < line["engine_utilisation_to_last_phase"] <= 1.0
    assert line["engine_idle_run_end"] > 0  # the last batch trains after the last phase, in every mode
    if overlap == "none":  # the engines wait through every step's training and sync but the last
        assert line["engine_idle_between_phases"] * line["wall_s"] == pytest.approx(
            sum(per_token * t for t in out["phase_trained_tokens"][:-1]) + 1.0 * (len(out["phase_s_exact"]) - 1))
    if overlap == "async":  # training as long as generation: most syncs land inside a phase and stop it
        assert 0 < line["engine_idle_sync"] * line["wall_s"] <= 1.0 * len(out["phase_s_exact"])


def test_async_engines_wait_on_a_slow_trainer_at_a_tight_bound():
    out = _partial()
    per_token = 3 * sum(out["phase_s_exact"]) / sum(out["phase_trained_tokens"])  # training 3x generation
    runs = {k: _partial(k=k, trainer=TrainerModel("async", per_token, 0.0)) for k in (0, 4)}
    tight, loose = (with_trainer(runs[k], "async", per_token, 0.0, k) for k in (0, 4))
    assert runs[0]["staleness_max"] == 0 and runs[4]["staleness_max"] <= 4
    # k 0: each phase waits until the step before it is trained, as under none
    waited = sum(per_token * t for t in runs[0]["phase_trained_tokens"][:-1])
    assert tight["engine_idle_between_phases"] * tight["wall_s"] == pytest.approx(waited)
    assert loose["engine_idle_between_phases"] < tight["engine_idle_between_phases"]
    assert loose["samples_per_s"] > tight["samples_per_s"]


def test_the_tool_reports_each_overlap():
    out = subprocess.run([sys.executable, str(TOOL), "--workload", "lognormal", "--prompts", "64", "--engines", "2",
                          "--slots", "32", "--prompts-per-step", "8", "--max-tokens", "2048", "--steps", "4",
                          "--mode", "partial", "--overlap", "all"], capture_output=True, text=True, check=True)
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    modelled = {x["overlap"]: x for x in lines if x.get("overlap")}
    assert set(modelled) == {"none", "one_step", "async"}
    assert modelled["async"]["samples_per_s"] > modelled["none"]["samples_per_s"]
    for line in modelled.values():
        assert line["engine_utilisation"] + sum(v for k, v in line.items() if k.startswith("engine_idle_")) == \
            pytest.approx(1.0)


def test_async_at_k0_is_none():  # pipeline.py's invariant 5: the same calls, so the same run and the same timeline
    plain = _partial(k=0)
    per_token = sum(plain["phase_s_exact"]) / sum(plain["phase_trained_tokens"])
    overlapped = _partial(k=0, trainer=TrainerModel("async", per_token, 0.5))
    assert overlapped["phase_s_exact"] == plain["phase_s_exact"]
    assert overlapped["phase_trained_tokens"] == plain["phase_trained_tokens"]
    a, n = with_trainer(overlapped, "async", per_token, 0.5, 0), with_trainer(plain, "none", per_token, 0.5, 0)
    assert {k: v for k, v in a.items() if k != "overlap"} == {k: v for k, v in n.items() if k != "overlap"}
