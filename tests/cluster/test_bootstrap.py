"""Rank bootstrap: what each launcher's environment means, without starting anything (pure Python)."""

import subprocess
import sys

from helpers.scripts import ROOT
from megarl.distributed.bootstrap import detect, tasks_per_node


def test_torchrun_environment_wins():
    env = {"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2",
           "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}
    got = detect(env)
    assert (got.source, got.rank, got.world_size, got.local_rank, got.local_world_size) == ("torchrun", 3, 4, 1, 2)
    assert (got.master_addr, got.master_port) == ("10.0.0.1", 29500)


def test_srun_direct_takes_rank_from_slurm_and_port_from_the_job():
    env = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_STEP_TASKS_PER_NODE": "2(x3),2", "SLURM_JOB_ID": "1234", "MASTER_ADDR": "10.1.1.1"}
    got = detect(env)
    assert (got.source, got.rank, got.world_size, got.local_rank, got.local_world_size) == ("slurm", 5, 8, 1, 2)
    assert got.master_addr == "10.1.1.1" and got.master_port == 20000 + 1234
    assert detect({**env, "MASTER_PORT": "4242"}).master_port == 4242


def test_the_batch_shell_alone_is_a_single_process():
    # sbatch's shell: SLURM_PROCID=0 and SLURM_NTASKS, but no step of several tasks.
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7", "SLURM_TASKS_PER_NODE": "1(x2)"}
    assert detect(env).source == "single" and detect({}).world_size == 1


def test_mpirun_inside_an_allocation_is_mpi_not_slurm():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}
    got = detect(env)
    assert (got.source, got.rank, got.world_size, got.local_rank, got.local_world_size) == ("mpi", 1, 2, 1, 2)
    hydra = detect({"PMI_RANK": "0", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "3"})
    assert (hydra.source, hydra.world_size, hydra.local_world_size) == ("mpi", 3, 3)
    pmix = detect({"PMIX_RANK": "1", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "0"})
    assert (pmix.source, pmix.rank, pmix.world_size) == ("mpi", 1, 2)


def test_tasks_per_node_expands_slurms_counts():
    assert tasks_per_node("4(x2),3") == [4, 4, 3] and tasks_per_node("1") == [1]


def test_launch_modules_import_neither_torch_nor_mpi4py():
    code = ("import sys, megarl.distributed.bootstrap, megarl.launch.plan, megarl.distributed.bootstrap as b; "
            "b.detect(); print(sorted(m for m in ('torch', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_with_gpus_the_default_group_has_a_backend_for_host_tensors_too():
    """NCCL alone takes CUDA tensors only; every rank's per-step flags (``collectives.any_rank``) are host tensors
    (tests/gpu/test_host_collectives_gpu.py runs both groups on a GPU)."""
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    from megarl.distributed.bootstrap import process_group_backend

    def devices(backend: str) -> dict:
        return {d: str(b) for d, b in BackendConfig(Backend(backend)).device_backend_map.items()}

    assert devices(process_group_backend(cuda=True)) == {"cpu": "gloo", "cuda": "nccl"}
    assert devices(process_group_backend(cuda=False))["cpu"] == "gloo"
    assert "cpu" not in devices("nccl")  # (the group megarl started with GPUs before)


def test_srun_mpi_takes_the_local_rank_and_size_from_slurm():
    """``srun --mpi=pmix`` exports PMIX_RANK but no local rank or size: Slurm's task's (each rank its own GPU,
    ``local_rank % GPUs``); mpirun's own win where it sets them."""
    env = {"PMIX_RANK": "9", "SLURM_STEP_NUM_TASKS": "16", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_PROCID": "9"}
    got = detect(env)
    assert (got.source, got.rank, got.world_size, got.local_rank, got.local_world_size) == ("mpi", 9, 16, 1, 8)
    ompi = detect({**env, "OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "16",
                   "OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert (ompi.local_rank, ompi.local_world_size) == (3, 4)


def test_two_trainer_ranks_on_one_gpu_are_refused_naming_them():
    """16 ranks a node on 8 GPUs would wrap (cuda:local_rank mod 8) onto used GPUs: refused at start, naming both
    ranks and the GPU; one GPU a task (``--gpus-per-task=1``: each at cuda:0 of its own) and CPU runs pass."""
    import pytest

    from megarl.distributed.bootstrap import gpu_identity, refuse_shared_gpus

    node = [("n1", f"GPU-{i}") for i in range(8)]
    refuse_shared_gpus(node + [("n2", f"GPU-{i}") for i in range(8)])  # same indices, other hosts: fine
    refuse_shared_gpus([None, None])  # CPU ranks
    with pytest.raises(RuntimeError, match=r"trainer ranks 0 and 8 are both on GPU GPU-0 of n1.*gpus-per-task=1"):
        refuse_shared_gpus(node + node)
    assert gpu_identity() is None  # (this CPU machine)
