"""Which cores each process of a run computes on: megarl chooses (``trainer.cpu_threads``, ``engine.cpu_threads``;
0, the default, is auto), from the cores this process may run on and the run's shape, and says so at start.

::

    who runs at once on a node                        each process's share of the node's cores
    the trainer and the engines take turns            the trainer's ranks split every core between them; so do
    (rollout.overlap: none, or colocated engines)      the replicas' workers (each side has the node to itself
                                                      while it runs)
    generation beside training                        the cores split between the two sides, in proportion to
    (rollout.overlap: one_step | async, replicas       their processes (a trainer rank, a replica's TP worker), each
     on the trainer's node)                           process pinned to cores of its own: two sides that both use
                                                      every core thrash (a 2-core step measured 0.5 s alone, 1.3-5.1 s
                                                      beside generation)

Under the split, rank 0's generating thread (it drives the replicas' engine steps) runs on the replicas' cores
(``RankPlacement.generating_thread``). A process that is alone in its side of the node is not pinned (the OS places
its threads); several are, each to its own cores. With fewer cores than processes nothing is pinned and each runs
one thread. A launcher that bound each process to cores of its own (srun under Slurm's task/affinity, ``mpirun
--bind-to core``, numactl) already split the node: the local ranks' CPU sets are then disjoint, and each rank
computes on its whole set (``rank_placement``), the replicas a rank spawns on a share of that rank's.
``OMP_NUM_THREADS`` in the environment (torchrun sets it to 1) is not what decides: these keys are. On GPUs the same
shares govern the host threads of each process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuShare:
    """One process's share: ``threads`` compute threads, pinned to ``cores`` (empty: not pinned)."""

    threads: int
    cores: tuple[int, ...] = ()

    def describe(self) -> str:
        where = f"core{'s' if len(self.cores) > 1 else ''} {_ranges(self.cores)}" if self.cores else "any core"
        return f"{where}, {self.threads} thread{'s' if self.threads != 1 else ''}"


@dataclass(frozen=True)
class NodePlacement:
    """The shares of one node: each local trainer rank's, and each replica's workers' (replicas in node order)."""

    trainer: list[CpuShare]
    replicas: list[list[CpuShare]]
    together: bool  # the two sides run at once (generation beside training)
    cores: tuple[int, ...]  # the node's cores, placed (bound: this rank's)
    trainer_threads: int = 0  # trainer.cpu_threads (0: auto)
    bound: bool = False  # the launcher bound each local rank to cores of its own: this is one rank's placement

    def describe(self) -> str:
        if self.bound:
            parts = [f"this trainer rank: {self.trainer[0].describe()}"]
        else:
            parts = [f"trainer rank {r}: {s.describe()}" for r, s in enumerate(self.trainer)]
        for k, workers in enumerate(self.replicas):
            parts += [f"replica {k}{f' worker {w}' if len(workers) > 1 else ''}: {s.describe()}"
                      for w, s in enumerate(workers)]
        how = "generation beside training: the cores split" if self.together else "trainer and engines take turns"
        where = "each rank's own cores, bound by its launcher" if self.bound else f"{len(self.cores)} cores"
        return f"cpu placement on {where} ({how}): " + "; ".join(parts)


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity: a Slurm allocation's, a cpuset's), in ``by_topology``'s
    order."""
    cpus = os.sched_getaffinity(0)
    return by_topology(cpus, {c: _topology(c) for c in cpus})


def _topology(cpu: int) -> tuple[int, int]:
    """(socket, physical core) of logical CPU ``cpu`` from sysfs; (0, cpu) where the kernel does not say."""
    root = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
        with open(root + "physical_package_id") as pkg, open(root + "core_id") as core:
            return int(pkg.read()), int(core.read())
    except (OSError, ValueError):
        return 0, cpu


def by_topology(cpus, topology: dict[int, tuple[int, int]]) -> list[int]:
    """``cpus`` socket by socket, each physical core's hyperthreads side by side (``topology``: a CPU's (socket,
    core)). Linux numbers a core's second hyperthread after every first one (0-63, then siblings 64-127), so
    slices of the sorted numbers would give two processes the two halves of the same cores, and a slice would
    straddle sockets where this order keeps whole cores of one socket together."""
    return sorted(cpus, key=lambda c: (*topology.get(c, (0, c)), c))


def _ranges(cores: tuple[int, ...]) -> str:
    out, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)


def _slices(cores: list[int], counts: list[int]) -> list[tuple[int, ...]]:
    """Consecutive slices of ``cores`` (``by_topology``'s order) of the given sizes, each sorted."""
    out, at = [], 0
    for n in counts:
        out.append(tuple(sorted(cores[at:at + n])))
        at += n
    return out


def _even(total: int, parts: int) -> list[int]:
    """``total`` split in ``parts`` near-equal positive sizes (the first ones larger)."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _side(cores: list[int], procs: int, threads: int, pin_alone: bool) -> list[CpuShare]:
    """``procs`` processes of one side on ``cores``, each ``threads`` threads (0: an even share of them), pinned to
    slices of their own when there are several or ``pin_alone`` (the side is not the whole node)."""
    if procs == 0:
        return []
    if len(cores) < procs:  # oversubscribed: one thread each, left to the OS
        return [CpuShare(1)] * procs
    sizes = [threads] * procs if threads else _even(len(cores), procs)
    if procs == 1 and not pin_alone:
        return [CpuShare(sizes[0])]
    return [CpuShare(n, s) for n, s in zip(sizes, _slices(cores, sizes))]


def place_node(cores: list[int], trainer_procs: int, replica_workers: list[int], together: bool,
               trainer_threads: int = 0, engine_threads: int = 0) -> NodePlacement:
    """The shares of a node with ``cores``, ``trainer_procs`` trainer ranks and replicas of ``replica_workers`` TP
    workers each; ``together``: both sides run at once. ``trainer_threads`` / ``engine_threads``: per process
    (0: auto). ``ValueError`` when the threads asked for are more than the node's cores."""
    n, workers = len(cores), sum(replica_workers)
    want_t, want_e = trainer_threads * trainer_procs, engine_threads * workers
    both = bool(together and trainer_procs and workers)
    if (want_t + want_e if both else max(want_t, want_e)) > n:
        asked = " + ".join(x for x in (
            f"trainer.cpu_threads={trainer_threads} × {trainer_procs} trainer ranks" if want_t else "",
            f"engine.cpu_threads={engine_threads} × {workers} replica workers" if want_e else "") if x)
        raise ValueError(f"{asked} asks for more than this node's {n} cores ({_ranges(tuple(sorted(cores)))}); "
                         "set fewer threads, or 0 (auto) to let megarl split the cores")
    if not both:
        trainer = _side(cores, trainer_procs, trainer_threads, False)
        flat = _side(cores, workers, engine_threads, False)
    elif n < trainer_procs + workers:  # fewer cores than processes: nothing pinned, one thread each
        trainer, flat = [CpuShare(1)] * trainer_procs, [CpuShare(1)] * workers
    else:
        auto = round(n * trainer_procs / (trainer_procs + workers))
        t = want_t or (n - want_e if want_e else min(max(auto, trainer_procs), n - workers))
        trainer = _side(cores[:t], trainer_procs, trainer_threads, True)
        flat = _side(cores[t:], workers, engine_threads, True)
    replicas, at = [], 0
    for w in replica_workers:
        replicas.append(flat[at:at + w])
        at += w
    return NodePlacement(trainer, replicas, both, tuple(cores), trainer_threads)


@dataclass(frozen=True)
class RankPlacement:
    """A trainer rank's place on its node: ``node.trainer[index]`` is its share."""

    node: NodePlacement
    index: int

    @contextlib.contextmanager
    def alone(self):
        """While the trainer computes and no engine does (the supervised warm-up, before the first phase) under a
        split placement: this rank takes its share of every core of the node, as when the sides take turns, and
        its split share again after."""
        node, procs = self.node, len(self.node.trainer)
        if not node.together or len(node.cores) < procs:
            yield
            return
        apply(_side(list(node.cores), procs, node.trainer_threads, True)[self.index])
        try:
            yield
        finally:
            apply(node.trainer[self.index])

    def generating_thread(self) -> None:
        """Called in rank 0's generating thread (generation beside training): it runs on the replicas' cores, not this
        rank's. It drives the engine steps one at a time and scores between them while the replicas wait for its
        next command, so it and they take turns on their cores, and training keeps this rank's cores to itself.
        Nothing when the replicas are not pinned (or not on this node)."""
        cores = sorted({c for workers in self.node.replicas for w in workers for c in w.cores})
        if self.node.together and cores:
            os.sched_setaffinity(0, cores)  # (Linux: the calling thread's, not the process's)


def replicas_on_node(placement: str, replicas: int, replica_nodes: int, dedicated: bool, node: int,
                     nodes: int) -> int:
    """How many disaggregated replicas run on trainer node ``node`` of ``nodes`` (``engines.remote.nodes.place``'s
    rule: all on rank 0's node, or ``replicas / replica_nodes`` on each of the last ``replica_nodes``; none on a
    trainer node when the engine nodes are dedicated)."""
    if placement != "disaggregated" or dedicated:
        return 0
    if replica_nodes == 0:
        return replicas if node == 0 else 0
    return replicas // replica_nodes if node >= nodes - replica_nodes else 0


def node_placement(cfg, trainer_procs: int, node: int = 0, nodes: int = 1, cores: list[int] | None = None,
                   hosts_replicas: bool = True) -> NodePlacement:
    """A run's placement (a ``RunConfig``) on trainer node ``node`` of ``nodes``, with ``trainer_procs`` trainer
    ranks there (0: an engine-only node) and its cores (default: this process's); ``hosts_replicas`` false: the
    node's replicas are not on these cores (a bound rank that does not spawn them)."""
    e = cfg.engine
    here = (e.replicas // max(1, e.replica_nodes) if trainer_procs == 0 else
            replicas_on_node(e.placement, e.replicas, e.replica_nodes, e.replica_nodes_dedicated, node, nodes))
    together = cfg.rollout.overlap != "none" and e.placement == "disaggregated"
    return place_node(available_cores() if cores is None else cores, trainer_procs,
                      [e.tensor_parallel_size] * (here if hosts_replicas else 0), together, cfg.trainer.cpu_threads,
                      e.cpu_threads)


def bound_apart(local_cores: list[tuple[int, ...]]) -> bool:
    """Whether a launcher bound each of a node's processes (``local_cores``: their CPU sets, local rank order) to
    cores of its own: several, pairwise disjoint. Shared or overlapping sets (no binding, a job's cgroup) are the
    node's cores, split by ``place_node``."""
    seen: set[int] = set()
    for cores in local_cores:
        if seen & set(cores):
            return False
        seen |= set(cores)
    return len(local_cores) > 1


def rank_placement(cfg, local_cores: list[tuple[int, ...]], local_rank: int, node: int = 0, nodes: int = 1
                   ) -> RankPlacement:
    """Trainer rank ``local_rank``'s placement among its node's processes (``local_cores``: each local rank's CPU
    set): the node's cores split between them (``node_placement``), or, bound apart by the launcher, its own set
    alone, shared with the replicas it spawns (the node's first rank spawns them: ``engines.remote.nodes.place``)."""
    if not bound_apart(local_cores):
        return RankPlacement(node_placement(cfg, len(local_cores), node, nodes, list(local_cores[local_rank])),
                             local_rank)
    own = node_placement(cfg, 1, node, nodes, list(local_cores[local_rank]), hosts_replicas=local_rank == 0)
    return RankPlacement(dataclasses.replace(own, bound=True), 0)


def apply(share: CpuShare) -> None:
    """This process computes with ``share``: its torch threads, and its cores when pinned (before vLLM starts in it:
    its CPU worker then refuses ``torch.set_num_threads``)."""
    import torch

    if share.cores:
        os.sched_setaffinity(0, share.cores)
    torch.set_num_threads(share.threads)


def vllm_binding(workers: list[CpuShare]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a replica whose TP workers are vLLM's own processes: each worker's cores,
    '|'-separated, or 'nobind' when they are not pinned (their threads: ``OMP_NUM_THREADS``)."""
    if all(w.cores for w in workers):
        return "|".join(",".join(map(str, w.cores)) for w in workers)
    return "nobind"
