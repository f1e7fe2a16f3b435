"""Invariants of the SortedRL controller, on simulated engines (pure Python, no vLLM)."""

import random

import pytest

from megarl.rollout.controller import ControllerConfig, PromptItem, RolloutController
from megarl.rollout.sim.engines import SimulatedEngine, StepTimeModel, sim_logprob, sim_token
from megarl.rollout.sim.simulator import SimSettings, paper_workload, simulate, sync_closed_form
from megarl.types import SampleStatus

G = 4


def make(mode, lengths, k=1, engines=2, slots=8, update=4, rollout=8, cap=64, keep=None, dispatch="pull",
         stale_action="regenerate", prompts=None):
    """A controller over simulated engines; lengths[i] gives prompt i's G sample lengths."""
    produced = []

    def next_prompt():
        i = len(produced)
        if prompts is not None and i >= prompts:
            return None
        produced.append(i)
        return PromptItem(i, [1, 2, 3], key=i % len(lengths), extras={"row": i})

    def length_of(key):
        return lengths[key[0] % len(lengths)][key[1]]

    cfg = ControllerConfig(mode=mode, group_size=G, update_groups=update, rollout_groups=rollout, max_tokens=cap,
                           staleness_limit=k, dispatch=dispatch, stale_action=stale_action)
    engs = [SimulatedEngine(slots, length_of, StepTimeModel("constant", 1.0), max_chunk=3) for _ in range(engines)]
    return RolloutController(cfg, engs, next_prompt, keep_group=keep), produced


def heavy_lengths(n, seed=0):
    rng = random.Random(seed)
    return [[rng.choice([3, 5, 8, 13, 40, 90]) + rng.randint(0, 4) for _ in range(G)] for _ in range(n)]


def run(ctrl, phases):
    out = []
    for v in range(phases):
        groups, m = ctrl.run_phase(v)
        out.append((v, groups, m))
    return out


@pytest.mark.parametrize("mode", ["sync", "on_policy", "partial"])
def test_no_prompt_lost_or_duplicated(mode):
    ctrl, produced = make(mode, heavy_lengths(30))
    released = [g.prompt_index for _, groups, _ in run(ctrl, 25) for g in groups]
    assert len(released) == len(set(released))
    live = set(ctrl.live)
    requeued = {item.index for item, _, _ in ctrl.requeued}
    long = {item.index for item, _, _ in ctrl.long_queue}
    assert not (live & requeued) and not (long & (live | requeued))
    assert not (set(released) & (live | requeued | long))
    assert set(released) | live | requeued | long == set(produced)


@pytest.mark.parametrize("mode", ["sync", "on_policy", "partial"])
def test_groups_released_whole_with_per_token_records(mode):
    lengths = heavy_lengths(30, seed=1)
    ctrl, _ = make(mode, lengths, k=3)
    for _, groups, _ in run(ctrl, 20):
        for g in groups:
            assert len(g.samples) == G and g.extras == {"row": g.prompt_index}  # its own row's columns
            for j, s in enumerate(g.samples):
                assert s.status == SampleStatus.CONSUMED and s.finish_reason in ("stop", "length")
                full = min(lengths[g.prompt_index % 30][j], 64)
                assert len(s.response_ids) == len(s.logprobs) == len(s.versions) == full
                # tokens and behaviour logprobs survive resumes position by position
                assert s.response_ids == [sim_token(t) for t in range(full)]
                assert s.logprobs == [sim_logprob((g.prompt_index, j), t) for t in range(full)]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_partial_staleness_is_bounded(k):
    ctrl, _ = make("partial", heavy_lengths(30, seed=2), k=k)
    interrupted = 0
    for v, groups, m in run(ctrl, 30):
        for g in groups:
            for s in g.samples:
                assert v - min(s.versions) <= k
                assert all(0 <= v - x <= k for x in s.versions)
                interrupted += s.interruptions
        assert max(m.staleness, default=0) <= k
    if k == 0:
        assert interrupted == 0  # nothing may be resumed: stale samples are regenerated
    else:
        assert interrupted > 0  # the bound was exercised by real resumes


def test_partial_resume_keeps_versions_per_token():
    ctrl, _ = make("partial", heavy_lengths(30, seed=3), k=3)
    mixed = 0
    for _, groups, _ in run(ctrl, 20):
        for g in groups:
            for s in g.samples:
                assert s.versions == sorted(s.versions)  # later tokens never older
                mixed += len(set(s.versions)) > 1
    assert mixed > 0


def test_on_policy_trains_only_current_version_and_requeues_discards():
    ctrl, _ = make("on_policy", heavy_lengths(30, seed=4))
    wasted = 0
    for v, groups, m in run(ctrl, 20):
        assert groups, "each phase yields an update batch"
        for g in groups:
            assert all(x == v for s in g.samples for x in s.versions)
            assert all(s.interruptions == 0 for s in g.samples)
        wasted += m.tokens_wasted
    assert wasted > 0  # discarding happened (and was counted)


@pytest.mark.parametrize("long_rounds", [False, True])
def test_on_policy_protects_a_prompt_discarded_too_often(long_rounds):
    lengths = [[200] * G] + [[3] * G] * 40  # prompt 0 is far longer than any phase
    ctrl, _ = make("on_policy", lengths, update=2, rollout=4, cap=256)
    ctrl.cfg.long_rounds = long_rounds
    phases = run(ctrl, 12)
    released = {g.prompt_index for _, groups, _ in phases for g in groups}
    assert 0 in released  # it was not starved
    assert all(len(groups) == 2 for _, groups, _ in phases)  # and no phase trained more than the update batch


def test_phase_ends_early_at_the_update_batch():
    ctrl, _ = make("partial", heavy_lengths(30, seed=5), update=3, rollout=9)
    for _, groups, m in run(ctrl, 10):
        assert len(groups) >= 3
        assert m.buffer_groups > 0


def test_short_groups_come_first():
    lengths = [[60] * G, [3] * G, [30] * G, [5] * G]
    ctrl, _ = make("sync", lengths, update=4, engines=1, slots=16)
    groups, _ = ctrl.run_phase(0)
    assert [g.prompt_index for g in groups] == [1, 3, 2, 0]  # completion order = shortest first


def test_dynamic_sampling_hook_drops_groups_without_blocking():
    kept_calls = []

    def keep(group):
        kept_calls.append(group.prompt_index)
        return group.prompt_index % 2 == 0

    ctrl, _ = make("partial", heavy_lengths(30, seed=6), keep=keep, update=3)
    for _, groups, m in run(ctrl, 8):
        assert len(groups) >= 3 and all(g.prompt_index % 2 == 0 for g in groups)
        assert m.tokens_wasted >= 0
    assert any(i % 2 for i in kept_calls)


def test_deterministic():
    def trace():
        ctrl, _ = make("partial", heavy_lengths(30, seed=7))
        return [([g.prompt_index for g in groups], m.summary()) for _, groups, m in run(ctrl, 10)]

    assert trace() == trace()


def test_lpt_beats_fifo_once_lengths_are_known():
    lengths = [[3] * G] * 15 + [[60] * G]  # the long prompt comes last in FIFO order
    results = {}
    for dispatch in ("pull", "lpt"):
        ctrl, _ = make("sync", lengths, update=16, engines=2, slots=8, dispatch=dispatch)
        phases = run(ctrl, 2)
        results[dispatch] = phases[1][2].bubble_ratio  # second epoch: lengths known
    assert results["lpt"] < results["pull"] - 0.05


@pytest.mark.parametrize("seed", [0, 1])
def test_sync_bubble_equals_closed_form(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(8 * 24)]
    s = SimSettings(group_size=8, engines=2, slots=16, prompts_per_step=4, max_tokens=200, step_time_model="constant")
    out = simulate(lengths, "sync", s)
    assert out["bubble_ratio"] == pytest.approx(sync_closed_form(lengths, 32, 200), abs=1e-9)
    assert out["samples_trained"] == len(lengths)


def test_textbook_eta_gen():
    lengths = [200, 220, 240, 260, 300, 1800, 320, 280]
    out = simulate(lengths, "sync", SimSettings(group_size=8, engines=1, slots=8, max_tokens=4096,
                                                step_time_model="constant"))
    assert out["eta_gen"] == pytest.approx(0.2514, abs=1e-4)
    assert 8 * max(lengths) == 14400 and sum(lengths) == 3620


def test_paper_workload_shape():
    lengths = paper_workload(0, 512, 8, 16384)
    capped = [min(x, 16384) for x in lengths]
    assert sum(x <= 3000 for x in capped) / len(capped) == pytest.approx(0.80, abs=0.04)
    assert sum(x == 16384 for x in capped) / len(capped) == pytest.approx(0.05, abs=0.02)


def test_invalid_config_is_rejected():
    with pytest.raises(ValueError, match="mode"):
        ControllerConfig(mode="async").validate()
    with pytest.raises(ValueError, match="rollout_groups"):
        ControllerConfig(mode="partial", update_groups=8, rollout_groups=4).validate()
    with pytest.raises(ValueError, match="max_update_groups"):
        ControllerConfig(mode="partial", update_groups=8, rollout_groups=16, max_update_groups=4).validate()


def test_sync_dynamic_sampling_replaces_filtered_groups_up_to_the_cap():
    def keep(group):
        return group.prompt_index % 3 == 0

    ctrl, _ = make("sync", heavy_lengths(30, seed=8), keep=keep, update=2, rollout=2)
    ctrl.cfg.release_cap = 12
    groups, m = ctrl.run_phase(0)
    assert len(groups) == 2 and all(g.prompt_index % 3 == 0 for g in groups)
    assert m.groups_filtered >= 2

    ctrl, _ = make("sync", heavy_lengths(30, seed=8), keep=lambda g: False, update=2, rollout=2)
    ctrl.cfg.release_cap = 5
    groups, m = ctrl.run_phase(0)
    assert groups == [] and m.groups_filtered == 5  # the cap bounds the search


@pytest.mark.parametrize("mode", ["on_policy", "partial"])
def test_dynamic_sampling_cap_ends_a_phase_with_no_useful_group(mode):
    """Every group filtered (a verifier that always fails, a task the policy always solves): the phase ends once
    the cap's groups were released, with nothing to train (the step is skipped). It ran until the prompt stream
    ran out — forever on a dataset that repeats — since the cap was only looked at once a group was useful."""
    ctrl, produced = make(mode, heavy_lengths(30, seed=8), keep=lambda g: False, update=2, rollout=4, prompts=300)
    ctrl.cfg.release_cap = 6  # (a finite stream: without the cap a phase ends only when it runs out, and fails below)
    for v in range(4):
        groups, m = ctrl.run_phase(v)
        assert groups == []
        if not m.long_rounds:  # (on-policy: a long round runs its long prompts, the ones held back, to the end)
            assert 6 <= m.groups_filtered < 6 + 8  # ends at the cap (groups finishing in one step)
    assert len(produced) < 80  # a few phases' worth of prompts, not a sweep of the stream
    ctrl, _ = make(mode, heavy_lengths(30, seed=8), keep=lambda g: g.prompt_index % 7 == 0, update=2, rollout=4)
    ctrl.cfg.release_cap = 6
    groups, m = ctrl.run_phase(0)
    assert len(groups) + m.groups_filtered < 6 + 8 and all(g.prompt_index % 7 == 0 for g in groups)


def test_on_policy_keeps_the_unfinished_samples_of_a_phase_that_released_nothing():
    """No group released, no update follows: the samples still running were sampled by the policy the next phase
    runs too (same version), so they are kept and resumed, not discarded and re-queued."""
    ctrl, _ = make("on_policy", heavy_lengths(30, seed=8), keep=lambda g: False, update=2, rollout=4, prompts=300)
    ctrl.cfg.release_cap = 6
    groups, m = ctrl.run_phase(0)
    assert groups == [] and not ctrl.requeued  # (its tokens_wasted: the filtered groups)
    begun = {i: [len(s.response_ids) for s in g.samples] for i, g in ctrl.live.items()
             if any(s.response_ids for s in g.samples)}
    assert begun, "the cap ended the phase with long samples still running"
    ctrl.keep_group = lambda g: True
    ctrl.run_phase(0)  # the same version: what was begun goes on from where it was
    for i, before in begun.items():
        g = ctrl.live.get(i)
        if g is not None:
            assert all(len(s.response_ids) >= n for s, n in zip(g.samples, before))
            assert all(v == 0 for s in g.samples for v in s.versions)
