"""The parallel layout's rules, in one place: against the world size, the model's shape and the job's nodes.

Shared by config validation, the converters (``--tp``/``--pp``/... flags: ``flags=True`` names them so),
``megarl plan``, ``python -m megarl.launch`` and the engines' placement at start.
"""

from __future__ import annotations

from megarl.config.errors import ConfigError
from megarl.models.hf_config import num_experts


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_world_layout(cfg, world_size: int, hf: dict | None = None) -> None:
    """``parallel.*`` and the colocated engine TP against the world size (the model's experts when ``hf`` is given)."""
    p = cfg.parallel
    for key in ("tp", "pp", "vpp", "ep", "cp"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key} must be >= 1, got {getattr(p, key)}")
    if p.etp < 0:
        raise ConfigError(f"parallel.etp must be >= 0 (0: same as tp), got {p.etp}")
    if world_size % (p.tp * p.pp):
        raise ConfigError(f"parallel.tp × parallel.pp = {p.tp}×{p.pp} must divide the world size {world_size}; "
                          f"valid tp×pp products: {divisors(world_size)}")
    if world_size % (p.tp * p.pp * p.cp):
        raise ConfigError(f"parallel.cp={p.cp}: tp × pp × cp = {p.tp}×{p.pp}×{p.cp} must divide the world size "
                          f"{world_size}; valid cp: {divisors(world_size // (p.tp * p.pp))}")
    check_context_parallel(cfg)
    dp = world_size // (p.tp * p.pp * p.cp)
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1")
    etp = p.etp or p.tp
    if (p.ep * etp) > 1 and (dp * p.tp * p.cp) % (p.ep * etp):
        raise ConfigError(expert_layout_error(p, dp, num_experts(hf) if hf else 0))
    e = cfg.engine
    if e.placement == "colocated" and (e.tensor_parallel_size < 1 or world_size % e.tensor_parallel_size):
        raise ConfigError(  # world/TP colocated replicas (megarl/engines/colocated.py); TP = world: one engine
            f"engine.tensor_parallel_size={e.tensor_parallel_size} must divide the world size {world_size} "
            f"(colocated placement: world/TP engine replicas); valid: {divisors(world_size)}")


def check_context_parallel(cfg) -> None:
    """``parallel.cp`` > 1 against the trainer's settings: CP cuts packed rows (each padded to a multiple of 2·cp, so
    rows of any length run), hence ``trainer.packing``; a token budget holds a row's padded length only when it is a
    multiple of 2·cp; R2's recording is not split over CP ranks."""
    p, t = cfg.parallel, cfg.trainer
    if p.cp == 1:
        return
    if not t.packing:
        raise ConfigError(f"parallel.cp={p.cp} cuts packed rows over the CP ranks: set trainer.packing=true "
                          "(padded micro-batches, trainer.packing=false, have no context-parallel path)")
    if t.max_tokens_per_microbatch % (2 * p.cp):
        budget = t.max_tokens_per_microbatch
        raise ConfigError(f"trainer.max_tokens_per_microbatch={budget} must be a multiple of 2 × parallel.cp = "
                          f"{2 * p.cp} (each row is padded to a multiple of 2·cp; a row of the budget's length must "
                          f"fit): e.g. {-(-budget // (2 * p.cp)) * 2 * p.cp}")
    if cfg.algo.routing_replay == "trainer":
        raise ConfigError(f"algo.routing_replay=trainer (R2: the trainer records its own routes) is not supported at "
                          f"parallel.cp={p.cp}; valid there: none, rollout, auto (the engine's routes, split over CP "
                          "ranks like the tokens)")


def check_model_layout(hf: dict, tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 0, vpp: int = 1,
                       flags: bool = False, model: str = "this model") -> None:
    """The model's shape takes this layout: TP divides the heads, KV heads and vocabulary, PP × VPP the layers,
    EP the experts, expert TP the expert FFN. ``flags``: name the converters' ``--tp`` etc. instead of the
    config keys."""
    def key(name: str) -> str:
        return f"--{name}" if flags else f"parallel.{name}"

    def said(name: str, value: int) -> str:
        return f"--{name} {value}" if flags else f"parallel.{name}={value}"

    heads, kv, layers, vocab = (hf["num_attention_heads"], hf["num_key_value_heads"], hf["num_hidden_layers"],
                                hf["vocab_size"])
    experts = num_experts(hf)
    if heads % tp or kv % tp:
        valid = [d for d in divisors(kv) if heads % d == 0 and vocab % d == 0]
        raise ConfigError(f"{said('tp', tp)} must divide attention heads ({heads}) and KV heads ({kv}); valid: {valid}")
    if vocab % tp:
        raise ConfigError(f"{said('tp', tp)} must divide the vocabulary size ({vocab})")
    if layers % pp:
        raise ConfigError(f"{said('pp', pp)} must divide the number of layers ({layers}); valid: {divisors(layers)}")
    if vpp > 1 and pp == 1:
        raise ConfigError(f"{said('vpp', vpp)} needs {key('pp')} > 1 (virtual stages interleave pipeline ranks)")
    if layers % (pp * vpp):
        raise ConfigError(f"{said('vpp', vpp)}: pp × vpp = {pp * vpp} must divide the number of layers ({layers}); "
                          f"valid vpp: {divisors(layers // pp)}")
    if ep > 1 and not experts:
        raise ConfigError(f"{said('ep', ep)} needs an MoE model; {model} is dense (valid: 1)")
    if experts and experts % ep:
        raise ConfigError(f"{said('ep', ep)} must divide the number of experts ({experts}); valid: {divisors(experts)}")
    ffn = hf.get("moe_intermediate_size") or hf.get("intermediate_size") or 0
    if experts and ffn and ffn % (etp or tp):
        raise ConfigError(f"{said('etp', etp or tp)} must divide the expert FFN size ({ffn}); valid: "
                          f"{divisors(ffn)[:12]}")


def check_job_shape(cfg, hf: dict, nodes: int, gpus_per_node: int, node_gpus: int = 0) -> None:
    """What only the job's shape tells (on top of ``validate`` at its world size): TP groups inside a node, the
    nodes that host replicas and the GPUs their replicas take, vLLM's rule for the engine TP. ``gpus_per_node``:
    the trainer's processes per node; ``node_gpus``: each node's GPUs, when known (0: not checked)."""
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes ({nodes}) and --gpus-per-node ({gpus_per_node}) must be >= 1")
    # replicas spawned on the last N of these nodes (engines/remote/nodes.place)
    if not cfg.engine.replica_nodes_dedicated:
        check_replica_nodes_fit(cfg.engine.replicas, cfg.engine.replica_nodes, nodes, nodes * gpus_per_node)
    if cfg.engine.placement == "disaggregated":
        check_replica_devices(cfg.engine, gpus_per_node, node_gpus)
    tp, etp = cfg.parallel.tp, cfg.engine.tensor_parallel_size
    if gpus_per_node % tp:
        raise ConfigError(f"parallel.tp={tp} must divide the GPUs per node ({gpus_per_node}) so that a TP group "
                          f"stays inside a node; valid: {divisors(gpus_per_node)}")
    heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    if heads % etp or (kv % etp and etp % kv):
        raise ConfigError(f"engine.tensor_parallel_size={etp} must divide the attention heads ({heads}) and "
                          f"divide or be a multiple of the KV heads ({kv}) (vLLM's rule)")


def replica_device_ids(devices: str) -> list[int]:
    """``engine.replica_devices`` as CUDA device ids ('6,7' → [6, 7]); ConfigError unless distinct ids >= 0."""
    ids = [d.strip() for d in devices.split(",") if d.strip()]
    if not all(d.isdigit() for d in ids) or len(set(ids)) != len(ids):
        raise ConfigError(f"engine.replica_devices={devices!r}: must be distinct CUDA device ids of a node, "
                          "comma-separated (e.g. '6,7')")
    return [int(d) for d in ids]


def check_replica_devices(e, trainer_per_node: int, node_gpus: int = 0) -> None:
    """``engine.replica_devices`` against the node: a trainer process holds the GPU of its local rank
    (``bootstrap``: 0 .. processes per node − 1), so on nodes that also run trainer ranks (not
    ``engine.replica_nodes_dedicated``) the replicas take GPUs from ``trainer_per_node`` on; and every id is one of
    the node's ``node_gpus`` (0: not known, not checked)."""
    ids = replica_device_ids(e.replica_devices)
    if ids and not e.replica_nodes_dedicated and min(ids) < trainer_per_node:
        free = f"{trainer_per_node}..{node_gpus - 1}" if node_gpus > trainer_per_node else "none"
        raise ConfigError(f"engine.replica_devices={e.replica_devices!r} takes GPU {min(ids)}, which trainer local "
                          f"rank {min(ids)} holds (the trainer runs {trainer_per_node} processes a node, on GPUs "
                          f"0..{trainer_per_node - 1}: TRAINER_GPUS_PER_NODE / --nproc); valid ids: {free} "
                          "(start the trainer on fewer processes a node to free GPUs for the replicas)")
    if ids and node_gpus and max(ids) >= node_gpus:
        raise ConfigError(f"engine.replica_devices={e.replica_devices!r} names GPU {max(ids)}, but a node has "
                          f"{node_gpus} GPUs (0..{node_gpus - 1})")
    if node_gpus and not e.replica_nodes_dedicated and trainer_per_node + len(ids) > node_gpus:
        raise ConfigError(f"engine.replica_devices={e.replica_devices!r}: {len(ids)} replica GPUs + "
                          f"{trainer_per_node} trainer processes a node exceed the node's {node_gpus} GPUs")


def check_replica_share(replicas: int, replica_nodes: int) -> None:
    """The hosting nodes take equal shares: ``engine.replica_nodes`` divides ``engine.replicas``
    (0: no hosting nodes)."""
    if replica_nodes and replicas % replica_nodes:
        raise ConfigError(f"engine.replica_nodes={replica_nodes} must divide engine.replicas={replicas} "
                          "(the hosting nodes take equal shares)")


def expert_layout_error(p, dp: int, experts: int = 0) -> str:
    """Why ``parallel.ep × parallel.etp`` does not divide tp×dp: etp's default (0 → tp) spelled out, the valid ep
    values (dividing tp×dp/etp and the expert count) and, when etp defaulted, those with ``parallel.etp=1``."""
    etp, group = p.etp or p.tp, dp * p.tp * p.cp

    def valid(e: int) -> list[int]:
        return [d for d in divisors(group // e) if not experts or experts % d == 0] if group % e == 0 else []

    implicit = f" (parallel.etp=0 → parallel.tp={p.tp})" if not p.etp and p.tp > 1 else ""
    of = f" and the {experts} experts" if experts else ""
    dims = "tp×cp×dp" if p.cp > 1 else "tp×dp"
    msg = (f"parallel.ep={p.ep} × parallel.etp={etp}{implicit} = {p.ep * etp} must divide {dims} = {group}; "
           f"valid ep (dividing {dims} / etp{of}): {valid(etp) or 'none with this etp'}")
    if etp > 1:
        msg += f" (or set parallel.etp=1: valid ep {valid(1)})"
    return msg


def check_replica_nodes_fit(replicas: int, replica_nodes: int, trainer_nodes: int, trainer_processes: int = 0) -> None:
    """``engine.replica_nodes`` (replicas spawned by trainer ranks, not ``replica_nodes_dedicated``) against the job's
    trainer nodes, known before launch: Slurm's node count, ``--nproc`` on one machine, torchrun's world / local
    world."""
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
