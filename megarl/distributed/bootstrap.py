"""Find this process's rank, world size, local rank and rendezvous from whoever started it.

Looked for in this order: torchrun, MPI, Slurm (why MPI before Slurm: below).

1. torchrun (``TORCHELASTIC_RUN_ID`` or ``RANK`` + ``WORLD_SIZE`` + ``MASTER_ADDR``):
   everything is already in the environment; ``init_process_group(env://)`` joins.
2. MPI (``mpirun``: ``OMPI_COMM_WORLD_*``; MPICH hydra: ``PMI_*``; ``srun --mpi=pmix``:
   ``PMIX_RANK``): ``mpi4py`` is imported only then, at ``init_distributed``. Rank 0
   starts a ``TCPStore`` on a free port and broadcasts ``addr:port``; everyone joins the
   default group on that store (no port race).
3. ``srun`` direct, one task per GPU (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` > 1):
   rank/world/local rank from Slurm; the rendezvous host is the first host of
   ``SLURM_JOB_NODELIST`` (``scontrol show hostnames``), turned into its address
   with ``scontrol show node`` (its ``NodeAddr``); the port is ``MASTER_PORT`` if the
   job script exported one, else one derived from the job id.

The MPI variables are looked at before Slurm's: ``mpirun`` inside an allocation inherits
the batch shell's ``SLURM_*``, and ``srun --mpi=pmix`` asks for MPI. The batch shell has
no ``SLURM_STEP_NUM_TASKS``: only a step of several tasks counts as a Slurm launch.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Launch:
    """Where this process sits in the job, and how the default process group meets."""

    source: str
    """'torchrun', 'slurm', 'mpi' or 'single'."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str = ""
    """Rendezvous host ('' for MPI: rank 0 decides at init)."""
    master_port: int = 0


def _int(env, *names: str, default: int | None = None) -> int | None:
    for name in names:
        if env.get(name, "") != "":
            return int(env[name])
    return default


def _mpi(env) -> Launch | None:
    rank = _int(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    # srun --mpi=pmix exports PMIX_RANK but no size: Slurm's step size is the world.
    world = _int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS", default=1)
    if rank is None or world < 2:
        return None
    # srun --mpi=pmix/pmi2 exports no local rank or size of its own: Slurm's task's (mpirun's and hydra's first)
    local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID", default=0)
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")
    return Launch("mpi", rank, world, local, local_size or _slurm_local_size(env))


def _slurm(env) -> Launch | None:
    tasks = _int(env, "SLURM_STEP_NUM_TASKS", default=0)
    if env.get("SLURM_PROCID", "") == "" or tasks <= 1:
        return None
    host = first_host(env["SLURM_JOB_NODELIST"]) if env.get("SLURM_JOB_NODELIST") else "127.0.0.1"
    port = _int(env, "MASTER_PORT", default=None) or 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000
    return Launch("slurm", int(env["SLURM_PROCID"]), tasks, int(env.get("SLURM_LOCALID", "0")),
                  _slurm_local_size(env), env.get("MASTER_ADDR") or host, port)


def _slurm_local_size(env) -> int:
    """Tasks of this Slurm step on this node (1 outside one)."""
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1")
    return per_node[min(int(env.get("SLURM_NODEID", "0")), len(per_node) - 1)]


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's ``4(x2),3`` → ``[4, 4, 3]``."""
    counts = []
    for part in spec.split(","):
        n, _, rep = part.partition("(x")
        counts += [int(n)] * (int(rep.rstrip(")")) if rep else 1)
    return counts


def detect(env=None) -> Launch:
    """The launcher of this process, from the environment only (never imports mpi4py)."""
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_RUN_ID") or all(env.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return Launch("torchrun", int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)),
                      int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1))),
                      env.get("MASTER_ADDR", ""), int(env.get("MASTER_PORT", 0) or 0))
    return _mpi(env) or _slurm(env) or Launch("single", 0, 1, 0, 1)


def first_host(nodelist: str) -> str:
    """The address of the first host of a Slurm node list (``n[1-2]`` → n1 → its NodeAddr)."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    host = out.stdout.split()[0]
    node = subprocess.run(["scontrol", "show", "node", host], capture_output=True, text=True)
    for field in node.stdout.split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1]
    return host


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now ('': on every interface, for a rendezvous other nodes reach)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _export(launch: Launch) -> None:
    """torchrun's variables, which megatron-core and vLLM's external launcher read."""
    os.environ.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size), LOCAL_RANK=str(launch.local_rank),
                      LOCAL_WORLD_SIZE=str(launch.local_world_size), MASTER_ADDR=launch.master_addr,
                      MASTER_PORT=str(launch.master_port))


def process_group_backend(cuda: bool) -> str:
    """The default group's backend: gloo on CPU; with GPUs NCCL for CUDA tensors and gloo for host ones. NCCL alone
    takes no host tensor ("No backend type associated with device type cpu"), and every rank exchanges small host
    flags and counts (``collectives.any_rank`` each step, the routing statistics); over gloo they run as on CPU,
    timeouts included. megatron's groups, made on the default one, take both."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def _init_mpi(launch: Launch, backend: str) -> Launch:
    import mpi4py

    mpi4py.rc.thread_level = "serialized"
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    store = None
    if rank == 0:
        addr = os.environ.get("MASTER_ADDR") or _own_address()
        store = dist.TCPStore(addr, 0, world, is_master=True, wait_for_workers=False)
        rendezvous = f"{addr}:{store.port}"
    else:
        rendezvous = None
    rendezvous = comm.bcast(rendezvous, root=0)
    addr, port = rendezvous.rsplit(":", 1)
    if store is None:
        store = dist.TCPStore(addr, int(port), world, is_master=False)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    launch = Launch("mpi", rank, world, local.Get_rank(), local.Get_size(), addr, int(port))
    _export(launch)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    return launch


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def init_distributed(launch: Launch | None = None) -> Launch:
    """Join the default process group as the launcher intends (torchrun/single: left to
    ``megarl.distributed.parallel.init_process_group``'s ``env://``, which reads what is exported here)."""
    launch = launch or detect()
    import torch

    backend = process_group_backend(torch.cuda.is_available())
    device = launch.local_rank % torch.cuda.device_count() if torch.cuda.is_available() else None
    if device is not None:
        torch.cuda.set_device(device)
    if launch.source == "mpi":
        launch = _init_mpi(launch, backend)
    elif launch.source == "slurm":
        _export(launch)
    if device is not None:
        # vLLM's external launcher (colocated engines) takes its GPU as cuda:LOCAL_RANK: this rank's device among
        # those it sees, which differs from its local rank where Slurm gives each task its own (--gpus-per-task)
        os.environ["LOCAL_RANK"] = str(device)
    return launch


def gpu_identity() -> tuple[str, str] | None:
    """(host, the GPU's UUID) of this rank's device; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return socket.gethostname(), str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def refuse_shared_gpus(identities: list) -> None:
    """Every trainer rank's ``gpu_identity`` (rank order): two on one GPU are refused, naming them. A node's ranks
    take cuda:(local rank mod the GPUs they see), so more ranks a node than its GPUs would wrap onto used ones
    (where each task sees one GPU of its own, ``--gpus-per-task=1``, each is at cuda:0 of its own)."""
    first: dict = {}
    for rank, gpu in enumerate(identities):
        if gpu is None:
            continue
        if gpu in first:
            raise RuntimeError(
                f"trainer ranks {first[gpu]} and {rank} are both on GPU {gpu[1]} of {gpu[0]}: each trainer rank "
                "needs a GPU of its own; launch as many ranks a node as it has GPUs (srun --ntasks-per-node, "
                "torchrun --nproc-per-node, the launch scripts' GPUS_PER_NODE) or give each task one "
                "(--gpus-per-task=1)")
        first[gpu] = rank


def end_distributed() -> None:
    """A finished run's last collective: every rank waits for the others, then the default group (and megatron's
    groups on it) is destroyed, so gloo's threads and NCCL's communicators end before the interpreter's teardown.
    A rank left to exit with them alive can abort after its work is done ("terminate called without an active
    exception", SIGABRT: seen on gloo), which the launcher reports as a failed job. A peer gone already: no wait.
    A vLLM engine in this process (colocated, in-process) destroys every group itself when it shuts down, the default
    one included (``vllm.distributed.parallel_state.cleanup_dist_env_and_memory``): its groups are left to it."""
    import torch.distributed as dist

    from megarl.distributed.watchdog import guard  # deferred: torch (fast --help and errors)

    if not dist.is_initialized():
        return
    try:
        with guard("the last barrier"):
            dist.barrier()
    except RuntimeError:  # a peer ended first (its error is its own): nothing left to wait for
        pass
    engine_groups = sys.modules.get("vllm.distributed.parallel_state")
    if engine_groups is None or not engine_groups.model_parallel_is_initialized():
        dist.destroy_process_group()


def local_address_to(host: str, fallback: str = "127.0.0.1") -> str:
    """The address of this host's interface that the route to ``host`` leaves by (``fallback`` with no route):
    what a process that dials ``host`` must bind and advertise, e.g. its gloo device (``weight_sync.transport``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))  # a UDP connect sends nothing: only the route is looked up
            return probe.getsockname()[0]
        except OSError:  # no route at all: one host is all there is
            return fallback

