"""Checks of where things run, shared by config validation, ``megarl plan``, ``python -m megarl.launch`` and the
engines' placement at start: the expert-parallel layout and the nodes that host disaggregated replicas."""

from __future__ import annotations

from megarl.config.errors import ConfigError


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_replica_share(replicas: int, replica_nodes: int) -> None:
    """The hosting nodes take equal shares: ``engine.replica_nodes`` divides ``engine.replicas`` (0: no hosting nodes)."""
    if replica_nodes and replicas % replica_nodes:
        raise ConfigError(f"engine.replica_nodes={replica_nodes} must divide engine.replicas={replicas} "
                          "(the hosting nodes take equal shares)")


def expert_layout_error(p, dp: int, experts: int = 0) -> str:
    """Why ``parallel.ep × parallel.etp`` does not divide tp×dp: etp's default (0 → tp) spelled out, the valid ep
    values (dividing tp×dp/etp and the expert count) and, when etp defaulted, those with ``parallel.etp=1``."""
    etp, group = p.etp or p.tp, dp * p.tp

    def valid(e: int) -> list[int]:
        return [d for d in divisors(group // e) if not experts or experts % d == 0] if group % e == 0 else []

    implicit = f" (parallel.etp=0 → parallel.tp={p.tp})" if not p.etp and p.tp > 1 else ""
    of = f" and the {experts} experts" if experts else ""
    msg = (f"parallel.ep={p.ep} × parallel.etp={etp}{implicit} = {p.ep * etp} must divide tp×dp = {group}; "
           f"valid ep (dividing tp×dp / etp{of}): {valid(etp) or 'none with this etp'}")
    if etp > 1:
        msg += f" (or set parallel.etp=1: valid ep {valid(1)})"
    return msg


def check_replica_nodes_fit(replicas: int, replica_nodes: int, trainer_nodes: int, trainer_processes: int = 0) -> None:
    """``engine.replica_nodes`` (replicas spawned by trainer ranks, not ``replica_nodes_dedicated``) against the job's
    trainer nodes, known before launch: Slurm's node count, ``--nproc`` on one machine, torchrun's world / local world."""
    if replica_nodes <= trainer_nodes:
        return
    procs = f" ({trainer_processes} trainer processes)" if trainer_processes else ""
    valid = [0] + [d for d in divisors(replicas) if d <= trainer_nodes]
    raise ConfigError(f"engine.replica_nodes={replica_nodes}: the job has {trainer_nodes} node(s){procs}; "
                      f"valid: {valid} (0: rank 0's node; N: the job's last N nodes, dividing engine.replicas="
                      f"{replicas}), or ask for more nodes")


def validate_replica_nodes(e) -> None:
    """``engine.replica_nodes`` on its own; against the job's node count at start (``engines.nodes.place``)."""
    if e.replica_nodes < 0:
        raise ConfigError(f"engine.replica_nodes must be >= 0 (0: the replicas on rank 0's node; N: on the job's "
                          f"last N nodes), got {e.replica_nodes}")
    if e.replica_nodes and e.placement != "disaggregated":
        raise ConfigError(f"engine.replica_nodes={e.replica_nodes} places disaggregated replicas; set "
                          "engine.placement=disaggregated or engine.replica_nodes=0")
    check_replica_share(e.replicas, e.replica_nodes)
    if e.replica_nodes_dedicated and e.replica_nodes < 1:
        raise ConfigError("engine.replica_nodes_dedicated=true gives the allocation's last engine.replica_nodes nodes "
                          f"to the replicas alone, but engine.replica_nodes={e.replica_nodes}; valid: "
                          "engine.replica_nodes >= 1 with it, or engine.replica_nodes_dedicated=false")
