"""A job's layout as ``megarl plan`` weighs it: the trainer's parallelism, where the vLLM engines run (colocated
with each sleep level, or on engine-only nodes) and their TP × replicas; the checks that refuse what cannot run,
and the layouts a plan tries.

    colocated       every GPU holds a trainer rank and a share of an engine: world / engine TP replicas;
                    engine.sleep_level 1 or 2 frees the engine's memory while the trainer trains,
                    trainer.offload_during_rollout the trainer's gradients and optimizer state while engines generate
    disaggregated   the job's last ``engine_nodes`` nodes run only replicas (engine.replica_nodes_dedicated):
                    engine_nodes × GPUs per node / engine TP of them; the trainer keeps the other nodes;
                    or, inside the trainer's nodes, the last ``engine_gpus`` GPUs of every node run replicas
                    (engine.replica_devices) and the trainer the first ``gpus_per_node`` (launched on that many
                    processes a node: TRAINER_GPUS_PER_NODE)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from megarl.config import ConfigError, validate
from megarl.config.schema import RunConfig
from megarl.config.validate.layout import check_job_shape, divisors, replica_device_ids
from megarl.models.hf_config import num_experts


@dataclass(frozen=True)
class Layout:
    nodes: int
    """The trainer's nodes (the job's, less engine-only ones)."""
    gpus_per_node: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    sequence_parallel: bool = False
    engine_tp: int = 1
    placement: str = "colocated"
    sleep_level: int = 0
    offload: bool = False
    """trainer.offload_during_rollout: gradients and optimizer state on the host while engines generate."""
    engine_nodes: int = 0
    """Disaggregated: the job's last nodes that run only replicas."""
    replicas: int = 1
    """Disaggregated replicas (colocated: world / engine TP, see ``engine_replicas``)."""
    engine_gpus: int = 0
    """Disaggregated inside the trainer's nodes: each node's GPUs after the trainer's ``gpus_per_node`` that run
    replicas (engine.replica_devices); 0: none."""
    recompute: str = "none"
    """trainer.recompute: the trainer's activation recompute ('none', 'selective', 'full')."""
    recompute_layers: int = 1
    """trainer.recompute_layers: layers per unit of full recompute."""
    cp: int = 1
    """parallel.cp: context parallelism, each micro-batch's positions split over cp ranks."""

    @property
    def node_gpus(self) -> int:
        """A node's GPUs: the trainer's and those of its replicas."""
        return self.gpus_per_node + self.engine_gpus

    @property
    def replica_devices(self) -> str:
        """engine.replica_devices: the GPUs after the trainer's, or every GPU of an engine-only node."""
        first = self.gpus_per_node if self.engine_gpus else 0
        return ",".join(str(d) for d in range(first, first + (self.engine_gpus or self.gpus_per_node)))

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        """Data parallelism: the ranks that train different rows."""
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def dp_cp(self) -> int:
        """The ranks one TP × PP shard is copied on (DP × CP): they reduce its gradients and shard its optimizer
        state, and each trains 1/dp_cp of a step's tokens."""
        return self.world // (self.tp * self.pp)

    @property
    def colocated(self) -> bool:
        return self.placement == "colocated"

    @property
    def engine_replicas(self) -> int:
        return self.world // self.engine_tp if self.colocated else self.replicas

    def overrides(self) -> list[str]:
        """The ``key=value`` settings that select this layout in ``megarl train``."""
        out = [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.vpp={self.vpp}",
               f"parallel.ep={self.ep}", f"parallel.etp={self.etp}",
               f"parallel.sequence_parallel={str(self.sequence_parallel).lower()}",
               f"engine.tensor_parallel_size={self.engine_tp}", f"trainer.recompute={self.recompute}"]
        if self.recompute == "full" and self.recompute_layers != 1:
            out.append(f"trainer.recompute_layers={self.recompute_layers}")
        if self.cp > 1:
            out.append(f"parallel.cp={self.cp}")
        if self.colocated:
            return out + [f"engine.sleep_level={self.sleep_level}",
                          f"trainer.offload_during_rollout={str(self.offload).lower()}"]
        out += ["engine.placement=disaggregated", f"engine.replicas={self.replicas}"]
        if self.engine_gpus:  # every node hosts its share (one node: rank 0's, the default)
            return out + [f"engine.replica_nodes={self.nodes if self.nodes > 1 else 0}",
                          f"engine.replica_devices={self.replica_devices}"]
        return out + [f"engine.replica_nodes={self.engine_nodes}", "engine.replica_nodes_dedicated=true",
                      f"engine.replica_devices={self.replica_devices}"]

    def describe(self, experts: bool) -> str:
        """'colocated, sleep 1: trainer TP 2 · PP 1 · EP 8 · ETP 1 · DP 8 | vLLM TP 2 × 8'."""
        where = (f"colocated, sleep {self.sleep_level}{' + offload' if self.offload else ''}" if self.colocated
                 else f"{self.engine_gpus} engine GPU{'s' if self.engine_gpus > 1 else ''} a node"
                 if self.engine_gpus else f"{self.engine_nodes} engine node{'s' if self.engine_nodes > 1 else ''}")
        moe = f" · EP {self.ep} · ETP {self.etp}" if experts else ""
        recompute = f" · recompute {self.recompute}" if self.recompute != "none" else ""
        cp = f" · CP {self.cp}" if self.cp > 1 else ""
        return (f"{where}: trainer TP {self.tp} · PP {self.pp}{moe}{cp} · DP {self.dp}{recompute} | "
                f"vLLM TP {self.engine_tp} × {self.engine_replicas}")


def engine_only_nodes(cfg: RunConfig) -> int:
    """How many of the allocation's last nodes run only engine replicas (``engine.replica_nodes_dedicated``), else 0."""
    return cfg.engine.replica_nodes if cfg.engine.replica_nodes_dedicated else 0


def trainer_nodes(cfg: RunConfig, nodes: int) -> int:
    """The job's nodes that run trainer ranks: all but the engine-only ones (``engine.replica_nodes_dedicated``)."""
    engine_only = engine_only_nodes(cfg)
    if engine_only and nodes - engine_only < 1:
        raise ConfigError(f"--nodes {nodes} leaves no trainer node beside engine.replica_nodes={engine_only} "
                          f"engine-only nodes (engine.replica_nodes_dedicated=true); "
                          f"valid: --nodes >= {engine_only + 1}")
    return nodes - engine_only


def engine_gpus_in_node(cfg: RunConfig) -> int:
    """GPUs of each trainer node that disaggregated replicas take (``engine.replica_devices`` on nodes that also run
    trainer ranks), else 0."""
    e = cfg.engine
    shared = e.placement == "disaggregated" and not e.replica_nodes_dedicated
    return len(replica_device_ids(e.replica_devices)) if shared else 0


def trainer_gpus_per_node(cfg: RunConfig, node_gpus: int, given: int = 0) -> int:
    """The trainer's processes per node: ``given`` (TRAINER_GPUS_PER_NODE, ``--trainer-gpus-per-node``), else the
    node's GPUs less those ``engine.replica_devices`` takes there; ConfigError when more than the node's."""
    trainer = given or node_gpus - engine_gpus_in_node(cfg)
    if not 1 <= trainer <= node_gpus:
        raise ConfigError(f"the trainer's processes per node ({trainer}: --trainer-gpus-per-node / "
                          f"TRAINER_GPUS_PER_NODE, else --gpus-per-node less engine.replica_devices="
                          f"{cfg.engine.replica_devices!r}) must be 1..{node_gpus} (--gpus-per-node)")
    return trainer


def layout_of(cfg: RunConfig, nodes: int, gpus_per_node: int) -> Layout:
    """The config's layout on ``nodes`` trainer nodes of ``gpus_per_node`` trainer processes."""
    p, e = cfg.parallel, cfg.engine
    return Layout(nodes, gpus_per_node, p.tp, p.pp, p.vpp, p.ep, p.etp or p.tp, p.sequence_parallel,
                  e.tensor_parallel_size, e.placement, e.sleep_level, cfg.trainer.offload_during_rollout,
                  engine_only_nodes(cfg), e.replicas, engine_gpus_in_node(cfg), cfg.trainer.recompute,
                  cfg.trainer.recompute_layers, p.cp)


def apply_layout(cfg: RunConfig, lay: Layout) -> RunConfig:
    par = replace(cfg.parallel, tp=lay.tp, pp=lay.pp, vpp=lay.vpp, ep=lay.ep, etp=lay.etp,
                  sequence_parallel=lay.sequence_parallel, cp=lay.cp)
    hosts = (lay.nodes if lay.nodes > 1 else 0) if lay.engine_gpus else lay.engine_nodes
    engine = replace(cfg.engine, tensor_parallel_size=lay.engine_tp, placement=lay.placement,
                     sleep_level=lay.sleep_level if lay.colocated else 0, replicas=lay.replicas,
                     replica_nodes=hosts, replica_nodes_dedicated=lay.engine_nodes > 0,
                     replica_devices="" if lay.colocated else lay.replica_devices)
    trainer = replace(cfg.trainer, offload_during_rollout=lay.offload, recompute=lay.recompute,
                      recompute_layers=lay.recompute_layers)
    return replace(cfg, parallel=par, engine=engine, trainer=trainer)


def check_layout(cfg: RunConfig, hf: dict, nodes: int, gpus_per_node: int, here: bool = True,
                 node_gpus: int = 0) -> None:
    """``validate`` at the job's world size plus what only the job's shape tells (``check_job_shape``);
    ConfigError names the key. ``gpus_per_node``: the trainer's processes per node, ``node_gpus``: the node's GPUs
    (0: not known). ``here``: the job runs on this machine's kind (not ``megarl plan`` on a login node)."""
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes ({nodes}) and --gpus-per-node ({gpus_per_node}) must be >= 1")
    validate(cfg, nodes * gpus_per_node, hf, here)
    check_job_shape(cfg, hf, nodes, gpus_per_node, node_gpus)


def trainer_layouts(hf: dict, nodes: int, gpus_per_node: int, max_pp: int = 16) -> list[Layout]:
    """The trainer's layouts on ``nodes`` nodes, smallest TP·PP first, then fewer stages, more experts split:
    TP within a node, PP up to ``max_pp``, EP over the experts, expert TP 1 or TP."""
    world, experts = nodes * gpus_per_node, num_experts(hf)
    out = []
    for tp, pp, ep, etp_one in itertools.product(divisors(gpus_per_node),
                                                 [d for d in divisors(hf["num_hidden_layers"]) if d <= max_pp],
                                                 divisors(experts or 1), (True, False)):
        etp = 1 if etp_one else tp
        if world % (tp * pp) or (etp_one and (tp == 1 or not experts)) or (world // pp) % (ep * etp):
            continue  # (experts: EP × expert TP divides TP × DP, check_world_layout's rule)
        out.append(Layout(nodes, gpus_per_node, tp, pp, 1, ep, etp, tp > 1))
    out.sort(key=lambda x: (x.tp * x.pp, x.pp, -x.ep, x.etp))
    return out


def colocated_layouts(hf: dict, nodes: int, gpus_per_node: int, sleep_levels=(0,), offload=(False,)):
    """Every trainer layout × engine TP (dividing the world: world / TP replicas) × sleep level × offload, in the
    order of preference ``--cpu`` proposes by (the first that fits)."""
    for lay in trainer_layouts(hf, nodes, gpus_per_node):
        for engine_tp, level, off in itertools.product(divisors(lay.world), sleep_levels, offload):
            yield replace(lay, engine_tp=engine_tp, sleep_level=level, offload=off)


def disaggregated_layouts(hf: dict, nodes: int, gpus_per_node: int):
    """The job's last nodes run only replicas of engine TP dividing a node (1, 2, 4, … and half of the nodes of
    them, fewer than all); the rest train."""
    for engine_nodes in sorted({n for n in (nodes // 2, *(2**k for k in range(nodes.bit_length()))) if 0 < n < nodes}):
        for lay in trainer_layouts(hf, nodes - engine_nodes, gpus_per_node):
            for engine_tp in divisors(gpus_per_node):
                yield replace(lay, engine_tp=engine_tp, placement="disaggregated", engine_nodes=engine_nodes,
                              replicas=engine_nodes * gpus_per_node // engine_tp)


def engine_gpu_layouts(hf: dict, nodes: int, node_gpus: int, engine_gpus: tuple[int, ...] = ()):
    """Every node gives its last g GPUs to replicas of engine TP dividing g (g: 1, 2, 4, … below the node's GPUs,
    or ``engine_gpus``); the trainer runs on the first node_gpus − g of each node."""
    for g in engine_gpus or range(1, node_gpus):
        for lay in trainer_layouts(hf, nodes, node_gpus - g):
            for engine_tp in divisors(g):
                yield replace(lay, engine_tp=engine_tp, placement="disaggregated", engine_gpus=g,
                              replicas=nodes * g // engine_tp)
