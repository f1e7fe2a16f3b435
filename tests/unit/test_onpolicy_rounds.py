"""On-policy long rounds under the batch step-time model (pure Python, simulated engines, no vLLM).

A long round runs its prompts to completion, so it lasts as long as its slowest engine:
its samples are placed longest first on the least-loaded engine (LPT). Under a step time
that grows with the batch, no on-policy schedule can keep every phase within a sync step
and also reach a small bubble: ``on_policy_bubble_floor`` computes the least bubble
possible, and these tests check it against schedules that keep the phase bound (sync
itself, small long rounds) and the contract (U groups per phase, all of one version, no
prompt starving) in each variant.
"""

import collections

import pytest

from megarl.rollout.controller import LONG_WAIT, ControllerConfig, PromptItem, RolloutController
from megarl.rollout.sim.engines import SimulatedEngine, StepTimeModel
from megarl.rollout.sim.simulator import SimSettings, on_policy_bubble_floor, paper_workload, simulate

G, CAP, ENGINES, SLOTS, U = 4, 256, 2, 16, 8  # a long round (U × G samples) fills every slot, as on the paper workload
# a full engine decodes 1.64× slower per step than an empty one (paper: 1.64×)
MODEL = StepTimeModel("batch", 0.02, 0.0008)


def paper_like(seed, prompts=96):
    """The paper workload's shape scaled to a 256-token cap: 80% short, 15% long, 5% of groups at the cap."""
    flat = [max(1, x * CAP // 16384) for x in paper_workload(seed, prompts, G, 16384)]
    return [flat[i:i + G] for i in range(0, len(flat), G)]


def make(mode, lengths, unbalanced=False, **kw):
    produced = []

    def next_prompt():
        i = len(produced)
        produced.append(i)
        return PromptItem(i, [1], key=i % len(lengths))

    cfg = ControllerConfig(mode=mode, group_size=G, update_groups=U, rollout_groups=U if mode == "sync" else 2 * U,
                           max_tokens=CAP, **kw)
    engines = [SimulatedEngine(SLOTS, lambda key: lengths[key[0] % len(lengths)][key[1]], MODEL, max_chunk=8)
               for _ in range(ENGINES)]
    ctrl = RolloutController(cfg, engines, next_prompt)
    if unbalanced:  # the shared pull queue only: what long rounds did before LPT placement
        ctrl.balance = lambda queue, only, engines: [collections.deque() for _ in engines]
    return ctrl, produced


def run(ctrl, phases):
    return [ctrl.run_phase(v) for v in range(phases)]


def summary(phases):
    total = sum(m.slot_time_total for _, m in phases)
    return {"bubble": 1 - sum(m.slot_time_busy for _, m in phases) / total,
            "phase_max": max(m.duration for _, m in phases),
            "long_max": max((m.duration for _, m in phases if m.long_rounds), default=0.0),
            "long_rounds": sum(m.long_rounds for _, m in phases),
            "tokens": sum(m.tokens_generated for _, m in phases),
            "at_cap": sum(s.finish_reason == "length" for groups, _ in phases for g in groups for s in g.samples)}


def test_balance_places_known_long_work_evenly():
    ctrl, _ = make("on_policy", paper_like(0))
    for i, hint in enumerate([900, 800, 300, 200, 100, 100]):
        ctrl._new_group(PromptItem(i, [1]), 0)
        ctrl.progress[i] = hint
    queue = ctrl.run_order(set(range(6)), set())
    own = ctrl.balance(queue, set(range(5)), ctrl.engines)  # prompt 5 is not a member: it stays shared
    assert [j for _, j in queue] == [0, 1, 2, 3] and {i for i, _ in queue} == {5}
    loads = [sum(ctrl.progress[i] for i, _ in q) for q in own]
    assert loads == [4600, 4600]  # 4 samples each of 900, 800, 300, 200, 100: split evenly
    assert [i for i, _ in own[0]][:2] == [0, 0] and [i for i, _ in own[1]][:2] == [0, 0]  # the longest on both
    assert all(len(q) <= SLOTS for q in own) and sum(map(len, own)) == 5 * G


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balanced_long_rounds_are_shorter_and_keep_the_contract(seed):
    lengths = paper_like(seed)
    balanced, unbalanced = make("on_policy", lengths)[0], make("on_policy", lengths, unbalanced=True)[0]
    phases = run(balanced, 24)
    for v, (groups, _) in enumerate(phases):
        assert len(groups) == U, f"phase {v} released {len(groups)} groups"
        assert all(x == v for g in groups for s in g.samples for x in s.versions)  # strictly on-policy
    ours, before = summary(phases), summary(run(unbalanced, 24))
    assert ours["long_rounds"] >= 4
    assert ours["long_max"] < before["long_max"] and ours["bubble"] < before["bubble"], (ours, before)


@pytest.mark.parametrize("long_round_groups", [0, 2])
def test_no_prompt_starves_in_long_rounds(long_round_groups):
    lengths = paper_like(3)
    ctrl, produced = make("on_policy", lengths, long_round_groups=long_round_groups)
    admitted_by, released_at = [], {}
    for v in range(40):
        groups, _ = ctrl.run_phase(v)
        assert len(groups) == U
        released_at.update((g.prompt_index, v) for g in groups)
        admitted_by.append(len(produced))
    bound = LONG_WAIT + 2
    for v in range(40 - bound):
        for i in range(admitted_by[v]):
            assert released_at.get(i, 10**9) <= v + bound, f"prompt {i} (admitted by phase {v}) starved"


def test_smaller_long_rounds_trade_bubble_for_shorter_phases():
    lengths = paper_like(0)
    full, small = summary(run(make("on_policy", lengths)[0], 24)), \
        summary(run(make("on_policy", lengths, long_round_groups=2)[0], 24))
    assert small["long_rounds"] > full["long_rounds"]
    assert small["long_max"] < full["long_max"] and small["bubble"] > full["bubble"], (small, full)


def test_bubble_floor_arithmetic():
    batch = StepTimeModel("batch")
    # the paper workload's on-policy run: 392 at-cap samples, 44.7M tokens, sync's longest phase 419.08 s:
    # ≤ 27 at-cap samples per engine-phase, each of ≥ 15 engine-phases idle ≥ 3.28·16384 − 100·419.08 slot-s
    idle = 15 * (3.28 * 16384 - 100 * 419.08)
    assert on_policy_bubble_floor(392, 44_749_816, 419.08, 16384, 64, batch) == \
        pytest.approx(idle / (idle + 0.0328 * 44_749_816))
    assert on_policy_bubble_floor(392, 44_749_816, 419.08, 16384, 64, StepTimeModel("constant")) == 0.0
    assert on_policy_bubble_floor(0, 10**6, 419.08, 16384, 64, batch) == 0.0
    assert on_policy_bubble_floor(1, 10**6, 300.0, 16384, 64, batch) == 1.0  # no phase of 300 s fits 16384 steps
    more_waste = on_policy_bubble_floor(392, 2 * 44_749_816, 419.08, 16384, 64, batch)
    assert more_waste < on_policy_bubble_floor(392, 44_749_816, 419.08, 16384, 64, batch)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bubble_floor_bounds_schedules_that_keep_the_phase_bound(seed):
    """Sync is an on-policy schedule whose phases keep its own bound: its bubble is above the floor; the
    long-round runs that beat the floor do so only with phases longer than sync's."""
    lengths = paper_like(seed)
    sync = summary(run(make("sync", lengths)[0], 24))
    floor = on_policy_bubble_floor(sync["at_cap"], sync["tokens"], sync["phase_max"], CAP, SLOTS, MODEL)
    assert 0 < floor <= sync["bubble"]
    for kw in ({}, {"long_round_groups": 2}):
        ours = summary(run(make("on_policy", lengths, **kw)[0], 24))
        floor = on_policy_bubble_floor(ours["at_cap"], ours["tokens"], sync["phase_max"], CAP, SLOTS, MODEL)
        assert ours["bubble"] >= floor or ours["phase_max"] > sync["phase_max"], (ours, floor)


@pytest.mark.slow
def test_paper_workload_on_policy_trade_off():
    """tools/simulate_rollout.py --workload sortedrl-paper, on-policy: the README's figures, within tolerance."""
    lengths = paper_workload(0, 512, 8, 16384)
    s = SimSettings(group_size=8, engines=8, slots=64, prompts_per_step=64, max_tokens=16384, steps=16,
                    staleness_limit=4)
    sync = simulate(lengths, "sync", s)
    full = simulate(lengths, "on_policy", s)
    small = simulate(lengths, "on_policy", SimSettings(**{**vars(s), "long_round_groups": 12}))
    for out in (full, small):
        assert out["groups_per_step_min"] == out["groups_per_step_max"] == 64 and out["staleness_max"] == 0
        assert out["wait_phases_max"] <= LONG_WAIT
    assert full["bubble_ratio"] <= 0.105 and full["phase_s_max"] <= 1.2 * sync["phase_s_max"]
    assert small["phase_s_max"] <= sync["phase_s_max"]  # every phase within a sync step ...
    floor = on_policy_bubble_floor(small["at_cap_samples_trained"], small["tokens_generated"], sync["phase_s_max"],
                                   16384, 64, StepTimeModel("batch"))
    assert 0.1 < floor <= small["bubble_ratio"]  # ... costs bubble: no such schedule gets near 6%


def test_bad_long_round_groups_is_a_config_error():
    from megarl.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError, match=r"rollout.long_round_groups must be >= 0 \(0: rollout.prompts_per_step\), "
                                          r"got -1"):
        validate(load_config(None, ["rollout.long_round_groups=-1"]), 1)
    validate(load_config(None, ["rollout.long_round_groups=4"]), 1)
    with pytest.raises(ValueError, match="long_round_groups must be >= 0"):
        ControllerConfig(mode="on_policy", long_round_groups=-1).validate()
