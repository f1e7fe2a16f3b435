"""megarl's cpu placement (``distributed/placement.py``): who computes on which cores, chosen from the run's shape."""

from __future__ import annotations

import os

import pytest

from megarl.config import ConfigError, load_config
from megarl.config.validate.limits import check_local_cpus
from megarl.distributed.placement import (
    CpuShare,
    RankPlacement,
    available_cores,
    bound_apart,
    by_topology,
    node_placement,
    place_node,
    rank_placement,
    replicas_on_node,
    vllm_binding,
)


def test_two_cores_split_when_generation_runs_beside_training():
    node = place_node([0, 1], 1, [1], together=True)
    assert node.trainer == [CpuShare(1, (0,))] and node.replicas == [[CpuShare(1, (1,))]]
    assert node.together and "the cores split" in node.describe()


def test_each_side_has_every_core_when_they_take_turns():
    node = place_node([0, 1], 1, [1], together=False)
    assert node.trainer == [CpuShare(2)] and node.replicas == [[CpuShare(2)]]  # unpinned: the OS places them
    two_ranks = place_node([0, 1], 2, [], together=False)  # several processes of one side: pinned apart
    assert two_ranks.trainer == [CpuShare(1, (0,)), CpuShare(1, (1,))]


def test_a_trainer_alone_under_a_split_placement_takes_every_core_then_its_share_again():
    """The supervised warm-up runs before any engine generates: under overlap's split the trainer computes on the
    whole node meanwhile (as when the sides take turns), and on its own share after (this process's real affinity
    and torch threads, put back at the end)."""
    import os

    import torch

    cores = available_cores()
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    saved = (os.sched_getaffinity(0), torch.get_num_threads())
    try:
        split = RankPlacement(place_node(cores[:2], 1, [1], together=True), 0)
        with split.alone():
            assert os.sched_getaffinity(0) == set(cores[:2]) and torch.get_num_threads() == 2
        assert os.sched_getaffinity(0) == {cores[0]} and torch.get_num_threads() == 1  # its split share
        ranks = place_node(cores[:2], 2, [], together=False)  # taking turns already: nothing changes
        os.sched_setaffinity(0, {cores[1]})
        with RankPlacement(ranks, 1).alone():
            assert os.sched_getaffinity(0) == {cores[1]}
        asked = RankPlacement(place_node(cores[:2], 1, [1], together=True, trainer_threads=1), 0)
        with asked.alone():  # trainer.cpu_threads=1 holds alone too
            assert torch.get_num_threads() == 1
    finally:
        os.sched_setaffinity(0, saved[0])
        torch.set_num_threads(saved[1])


def test_the_generating_thread_runs_on_the_replicas_cores_and_leaves_the_trainers_alone():
    """Under overlap's split, rank 0's generating thread (a real ``Pipeline`` thread, one_step's) steps the replicas
    and scores between their steps while they wait: it takes their cores, and the trainer's main thread keeps its
    own. When the sides take turns nothing is pinned."""
    import os

    from megarl.rollout.phase_metrics import PhaseMetrics
    from megarl.rollout.pipeline import Pipeline, Rollout

    cores = available_cores()
    if len(cores) < 2:
        pytest.skip("needs 2 cores")
    seen = []

    def generate(version: int, batch: int) -> Rollout:
        seen.append(os.sched_getaffinity(0))
        return Rollout([], PhaseMetrics(), batch=batch)

    saved = os.sched_getaffinity(0)
    try:
        for together in (True, False):
            node = place_node(cores[:2], 1, [1], together=together)
            main = set(node.trainer[0].cores or cores[:2])  # (the trainer's share: core 0 split, both alone)
            os.sched_setaffinity(0, main)
            p = Pipeline("one_step", generate, 1, on_thread=RankPlacement(node, 0).generating_thread)
            p.after_take()
            assert p.take()[0] is not None
            assert seen.pop() == ({cores[1]} if together else main)  # split: the replica's core; else inherited
            assert os.sched_getaffinity(0) == main  # the main thread's: unchanged
    finally:
        os.sched_setaffinity(0, saved)


def test_a_large_node_splits_by_processes_and_never_shares_a_core():
    node = place_node(list(range(16)), 8, [1, 1], together=True)
    cores = [c for s in node.trainer + [w for r in node.replicas for w in r] for c in s.cores]
    assert sorted(cores) == list(range(16)) and len(set(cores)) == 16  # every core used once
    assert sum(len(s.cores) for s in node.trainer) == round(16 * 8 / 10)  # the trainer's share: its processes'
    tp2 = place_node(list(range(16)), 2, [2], together=True, engine_threads=3)  # explicit engine threads
    assert [w.threads for w in tp2.replicas[0]] == [3, 3] and sum(s.threads for s in tp2.trainer) == 10


def test_fewer_cores_than_processes_pins_nothing():
    node = place_node([0, 1], 1, [1, 1], together=True)
    assert node.trainer == [CpuShare(1)] and node.replicas == [[CpuShare(1)], [CpuShare(1)]]


def test_threads_beyond_the_node_are_refused_naming_the_keys():
    with pytest.raises(ValueError, match=r"trainer.cpu_threads=2 × 1 trainer ranks \+ engine.cpu_threads=1 × 1 "
                                         r"replica workers asks for more than this node's 2 cores"):
        place_node([0, 1], 1, [1], together=True, trainer_threads=2, engine_threads=1)
    place_node([0, 1], 1, [1], together=False, trainer_threads=2, engine_threads=2)  # taking turns: each may have 2
    cfg = load_config(None, ["trainer.cpu_threads=64", "engine.placement=disaggregated", "rollout.overlap=async",
                             "rollout.mode=partial"])
    with pytest.raises(ConfigError, match="trainer.cpu_threads=64"):
        check_local_cpus(cfg, 1)
    with pytest.raises(ConfigError, match="engine.cpu_threads must be >= 0"):
        check_local_cpus(load_config(None, ["engine.cpu_threads=-1"]), 1)


def test_the_run_shape_decides_which_replicas_share_a_node():
    assert replicas_on_node("disaggregated", 4, 0, False, node=0, nodes=2) == 4  # all on rank 0's node
    assert replicas_on_node("disaggregated", 4, 0, False, node=1, nodes=2) == 0
    assert replicas_on_node("disaggregated", 4, 2, False, node=1, nodes=3) == 2  # the last 2 nodes host 2 each
    assert replicas_on_node("disaggregated", 4, 2, True, node=2, nodes=3) == 0  # engine-only nodes: none here
    assert replicas_on_node("colocated", 4, 0, False, node=0, nodes=1) == 0
    cfg = load_config(None, ["engine.placement=disaggregated", "rollout.overlap=async", "rollout.mode=partial"])
    assert node_placement(cfg, 1, cores=[0, 1]).together
    none = load_config(None, ["engine.placement=disaggregated"])
    assert not node_placement(none, 1, cores=[0, 1]).together


def test_a_rank_bound_to_its_own_cores_by_its_launcher_computes_on_all_of_them():
    # srun under task/affinity with --cpus-per-task=8 (or mpirun --bind-to core): 4 ranks of a 32-core node, each
    # its own 8 cores. Splitting each rank's set again among the 4 ranks would leave each 2 of them.
    sets = [tuple(range(8 * r, 8 * r + 8)) for r in range(4)]
    assert bound_apart(sets) and not bound_apart([tuple(range(32))] * 4) and not bound_apart(sets[:1])
    assert not bound_apart([(0, 1, 2), (2, 3)])  # overlapping: not a binding of each to its own
    cfg = load_config(None, ["engine.placement=disaggregated", "rollout.overlap=async", "rollout.mode=partial",
                             "engine.replicas=1"])
    third = rank_placement(cfg, sets, 2)
    assert third.node.bound and third.node.trainer[third.index] == CpuShare(8)  # its 8 cores, the OS places them
    assert third.node.replicas == [] and "this trainer rank: any core, 8 threads" in third.node.describe()
    first = rank_placement(cfg, sets, 0)  # the node's first rank spawns the replica: its cores split with it
    assert first.node.trainer[0].cores and set(first.node.trainer[0].cores) | set(first.node.replicas[0][0].cores) \
        == set(sets[0])
    shared = rank_placement(cfg, [tuple(available_cores())] * 2, 1)  # no binding: the node's cores split as before
    assert not shared.node.bound and len(shared.node.trainer) == 2 and shared.index == 1


def test_slices_are_whole_physical_cores_of_one_socket():
    """2 sockets × 4 cores × 2 hyperthreads as Linux numbers them: CPUs 0-7 the cores' first threads (0-3 socket 0),
    8-15 their siblings. Slices of the sorted numbers gave rank 2 the siblings of rank 0's cores; in topology
    order each of 4 ranks has two whole cores (both threads) of one socket."""
    topology = {c: (c % 8 // 4, c % 4) for c in range(16)}
    order = by_topology(range(16), topology)
    assert order[:4] == [0, 8, 1, 9] and order[8:12] == [4, 12, 5, 13]
    node = place_node(order, 4, [], together=False)
    assert [s.cores for s in node.trainer] == [(0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13), (6, 7, 14, 15)]
    assert "trainer rank 1: cores 2-3,10-11, 4 threads" in node.describe()
    assert by_topology([3, 1, 2], {}) == [1, 2, 3]  # where sysfs says nothing: the numbers' order
    assert sorted(available_cores()) == sorted(os.sched_getaffinity(0))


def test_vllm_binds_pinned_workers_and_leaves_the_rest():
    assert vllm_binding([CpuShare(2, (2, 3)), CpuShare(2, (4, 5))]) == "2,3|4,5"
    assert vllm_binding([CpuShare(1), CpuShare(1)]) == "nobind"
