"""The update-batch contract of the SortedRL controller, on simulated engines (pure Python, no vLLM).

A phase releases exactly U useful groups and never more than M, in every mode; no
prompt starves; no phase is longer than a synchronous one on the same trace;
admission keeps every free slot busy at any cluster size; the controller's state
(long-prompt queue included) survives a checkpoint round trip.
"""

import copy
import random

import pytest

from megarl.rollout.controller import LONG_WAIT, ControllerConfig, PromptItem, RolloutController
from megarl.rollout.sim.engines import SimulatedEngine, StepTimeModel
from megarl.rollout.sim.simulator import SimSettings, lognormal_workload, paper_workload, simulate

G = 4
VARIANTS = [("sync", {}), ("on_policy", {"long_rounds": False}), ("on_policy", {"long_rounds": True}),
            ("partial", {"staleness_limit": 2})]
IDS = ["sync", "on_policy-drain", "on_policy-long_rounds", "partial"]


def at_cap_lengths(n, cap, seed=0):
    """Half the prompts short, a third with samples at (or past) the cap: a starvation-prone trace."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        u = rng.random()
        if u < 0.5:
            out.append([rng.randint(2, 12) for _ in range(G)])
        elif u < 0.67:
            out.append([rng.randint(12, cap) for _ in range(G)])
        else:
            out.append([cap + rng.randint(0, 20) for _ in range(G)])
    return out


def make(mode, lengths, update=4, rollout=8, engines=2, slots=8, cap=64, step="batch", start=0, **kw):
    produced = []

    def next_prompt():
        i = start + len(produced)
        produced.append(i)
        return PromptItem(i, [1, 2, 3], key=i % len(lengths))

    def length_of(key):
        return lengths[key[0] % len(lengths)][key[1]]

    cfg = ControllerConfig(mode=mode, group_size=G, update_groups=update,
                           rollout_groups=update if mode == "sync" else rollout, max_tokens=cap, **kw)
    model = StepTimeModel(step, 0.02, 0.0002) if step == "batch" else StepTimeModel("constant", 1.0)
    engs = [SimulatedEngine(slots, length_of, model, max_chunk=3) for _ in range(engines)]
    return RolloutController(cfg, engs, next_prompt), produced


@pytest.mark.parametrize("mode,kw", VARIANTS, ids=IDS)
@pytest.mark.parametrize("trace", ["at_cap", "mixed"])
def test_every_phase_releases_exactly_the_update_batch(mode, kw, trace):
    lengths = at_cap_lengths(40, 64, seed=1) if trace == "at_cap" else \
        [[random.Random(i).choice([3, 7, 20, 64, 90]) for _ in range(G)] for i in range(40)]
    ctrl, _ = make(mode, lengths, **kw)
    for v in range(30):
        groups, m = ctrl.run_phase(v)
        assert len(groups) == 4, f"phase {v} released {len(groups)} groups"
        assert m.summary()["rollout/groups_released"] == 4


@pytest.mark.parametrize("mode,kw", VARIANTS, ids=IDS)
def test_flexible_batch_stays_within_max_update_groups(mode, kw):
    ctrl, _ = make(mode, at_cap_lengths(40, 64, seed=2), update=4, rollout=12, max_update_groups=6, **kw)
    sizes = [len(ctrl.run_phase(v)[0]) for v in range(25)]
    assert all(4 <= n <= 6 for n in sizes), sizes


@pytest.mark.parametrize("mode,kw", VARIANTS, ids=IDS)
def test_no_prompt_starves(mode, kw):
    """Every prompt admitted by phase p is trained by phase p + a bound (at-cap prompts included)."""
    ctrl, produced = make(mode, at_cap_lengths(40, 64, seed=3), **kw)
    admitted_by, released_at = [], {}
    for v in range(40):
        groups, m = ctrl.run_phase(v)
        released_at.update((g.prompt_index, v) for g in groups)
        admitted_by.append(len(produced))
    bound = LONG_WAIT + 2 if kw.get("long_rounds") else 10
    for v in range(40 - bound):
        for i in range(admitted_by[v]):
            assert i in released_at and released_at[i] <= v + bound, f"prompt {i} (admitted by phase {v}) starved"


@pytest.mark.parametrize("mode,kw", VARIANTS[1:], ids=IDS[1:])
def test_no_phase_longer_than_a_sync_phase(mode, kw):
    lengths = at_cap_lengths(48, 64, seed=4)
    step = "constant" if kw.get("long_rounds") else "batch"  # a long round is a sync step over long prompts
    sync, _ = make("sync", lengths, step=step)
    longest_sync = max(sync.run_phase(v)[1].duration for v in range(12))
    ctrl, _ = make(mode, lengths, step=step, **kw)
    for v in range(24):
        assert ctrl.run_phase(v)[1].duration <= longest_sync + 1e-9


def test_partial_holds_groups_past_the_bound_for_the_next_phase():
    lengths = [[5] * G] * 30  # every group completes at the same step: far more than U at once
    ctrl, _ = make("partial", lengths, update=2, rollout=6, engines=1, slots=24, staleness_limit=1)
    groups, m = ctrl.run_phase(0)
    assert len(groups) == 2 and m.groups_over_bound >= 2
    held = [i for i, g in ctrl.live.items() if all(s.response_ids for s in g.samples)]
    groups, m = ctrl.run_phase(1)
    assert [g.prompt_index for g in groups] == held[:2]  # released first, with their version-0 tokens
    assert m.staleness[1] == 2 * G * 5 and m.tokens_wasted == 0


def test_on_policy_discards_completions_past_the_bound():
    lengths = [[5] * G] * 30
    ctrl, _ = make("on_policy", lengths, update=2, rollout=6, engines=1, slots=24)
    groups, m = ctrl.run_phase(0)
    assert len(groups) == 2 and m.groups_over_bound >= 1 and m.tokens_wasted >= G * 5
    assert all(x == 0 for g in groups for s in g.samples for x in s.versions)


def test_admission_fills_every_free_slot_at_any_cluster_size():
    """Oversubscription 2 gives 2·U·G = 128 samples; 16 engines × 16 slots have twice as many slots."""
    lengths = lognormal_workload(0, 256, G, 2048, median=300)
    out = {}
    for engines in (2, 16):
        s = SimSettings(group_size=G, engines=engines, slots=16, prompts_per_step=16, max_tokens=2048, steps=4,
                        max_chunk=4)
        out[engines] = simulate(lengths, "partial", s)
    assert out[2]["bubble_ratio"] < 0.02 and out[16]["bubble_ratio"] < 0.02, out
    assert out[16]["groups_per_step_max"] == 16 and out[16]["staleness_max"] <= 2


def test_buffer_budget_bounds_admission():
    ctrl, _ = make("partial", at_cap_lengths(40, 64, seed=5), update=2, rollout=2, engines=4, slots=16,
                   buffer_samples=24)
    for v in range(10):
        ctrl.run_phase(v)
        unfinished = sum(1 for g in ctrl.live.values() for s in g.samples if not s.finish_reason)
        assert unfinished <= 24 + G


def test_state_dict_round_trip_with_the_long_queue():
    lengths = at_cap_lengths(40, 64, seed=6)
    ctrl, produced = make("on_policy", lengths, long_rounds=True)
    for v in range(5):
        ctrl.run_phase(v)
    assert ctrl.long_queue or ctrl.progress  # the new state is exercised
    state = copy.deepcopy(ctrl.state_dict())
    resumed, _ = make("on_policy", lengths, long_rounds=True, start=len(produced))
    resumed.load_state_dict(state)
    for v in range(5, 15):
        a, ma = ctrl.run_phase(v)
        b, mb = resumed.run_phase(v)
        assert [g.prompt_index for g in a] == [g.prompt_index for g in b] and ma.summary() == mb.summary()


def test_paper_workload_contract():
    """The paper workload, 4 steps: 64 groups every step in every mode; partial ≤ 1% bubble, shorter phases."""
    lengths = paper_workload(0, 512, 8, 16384)
    s = SimSettings(group_size=8, engines=8, slots=64, prompts_per_step=64, max_tokens=16384, steps=4,
                    staleness_limit=4)
    sync, partial = simulate(lengths, "sync", s), simulate(lengths, "partial", s)
    for out in (sync, partial):
        assert out["groups_per_step_min"] == out["groups_per_step_max"] == 64
    assert abs(sync["bubble_ratio"] - 0.76) <= 0.03
    assert partial["bubble_ratio"] <= 0.01 and partial["phase_s_max"] <= sync["phase_s_max"]
    assert partial["useful_tokens_per_s"] > 1.4 * sync["useful_tokens_per_s"]  # 2.8× over 16 steps, past the fill-up


@pytest.mark.slow
def test_paper_workload_targets():
    """The issue's targets on the paper workload (tools/simulate_rollout.py --workload sortedrl-paper)."""
    lengths = paper_workload(0, 512, 8, 16384)
    s = SimSettings(group_size=8, engines=8, slots=64, prompts_per_step=64, max_tokens=16384, steps=16,
                    staleness_limit=4)
    sync, partial = simulate(lengths, "sync", s), simulate(lengths, "partial", s)
    on_policy = simulate(lengths, "on_policy", SimSettings(**{**vars(s), "long_rounds": True}))
    assert on_policy["long_rounds"] >= 1
    for out in (sync, on_policy, partial):
        assert out["groups_per_step_min"] == out["groups_per_step_max"] == 64
    assert partial["bubble_ratio"] <= 0.01 and partial["phase_s_max"] <= sync["phase_s_max"]
    assert on_policy["bubble_ratio"] <= 0.15
    assert partial["useful_tokens_per_s"] > 2 * sync["useful_tokens_per_s"]


@pytest.mark.parametrize("override, message", [  # each names its own key and value, and only that (one message
    # blamed both max_update_groups and a valid buffer_samples=0)
    ("rollout.max_update_groups=3", r"^rollout.max_update_groups must be 0 or >= rollout.prompts_per_step \(32\), "
                                    r"got 3$"),
    ("rollout.buffer_samples=-1", r"^rollout.buffer_samples must be >= 0 \(0: no bound\), got -1$"),
    ("rollout.staleness_limit=-1", r"^rollout.staleness_limit must be >= 0, got -1$"),
    ("rollout.max_discards=0", r"^rollout.max_discards must be >= 1, got 0$"),
    ("rollout.oversubscription=1e9", r"^rollout.oversubscription must be in \[1.0, 64\] .*got 1000000000.0$"),
])
def test_bad_rollout_bounds_are_config_errors(override, message):
    from megarl.config import ConfigError, load_config, validate

    cfg = load_config(None, [override, "rollout.mode=partial"])
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 1)
    validate(load_config(None, ["rollout.max_update_groups=40", "rollout.long_rounds=false"]), 1)
