"""Parallel state as one explicit object, built once and handed to constructors.

This is the one place that touches Megatron's parallel globals
(``parallel_state.initialize_model_parallel``); everything else reads the
``ParallelState`` it is given: sizes, this process's ranks and the process groups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl.distributed.bootstrap import free_port, process_group_backend
from megarl.models.sharding import RankCoords


@dataclass(frozen=True)
class ParallelState:
    """Sizes and this process's ranks in every parallel dimension."""

    world_size: int
    rank: int
    tp: int
    pp: int
    ep: int
    etp: int
    dp: int
    vpp: int
    sequence_parallel: bool
    tp_rank: int
    pp_rank: int
    ep_rank: int
    etp_rank: int
    dp_rank: int
    cp: int = 1
    """Context-parallel size: the ranks that share each packed sequence, each holding 1/cp of its positions."""
    cp_rank: int = 0
    tp_group: object = field(default=None, compare=False, repr=False)
    """Megatron's tensor-parallel group (None outside a parallel run)."""
    pp_group: object = field(default=None, compare=False, repr=False)
    """The pipeline stages of this rank's model replica."""
    dp_group: object = field(default=None, compare=False, repr=False)
    """The data-parallel replicas of this rank's model shard (the same CP rank: each trains other rows)."""
    ep_group: object = field(default=None, compare=False, repr=False)
    """The expert-parallel ranks."""
    etp_group: object = field(default=None, compare=False, repr=False)
    """The expert tensor-parallel ranks."""
    cp_group: object = field(default=None, compare=False, repr=False)
    """The context-parallel ranks: the same rows, each its chunks of every row's positions."""

    def coords(self, vp_stage: int = 0) -> RankCoords:
        """Where this rank's model chunk ``vp_stage`` (0 without virtual stages) sits."""
        return RankCoords(self.tp_rank, self.tp, self.pp_rank, self.pp, self.ep_rank, self.ep, self.etp_rank, self.etp,
                          vp_stage, self.vpp)

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank computes the loss (holds the model's last layers, in its last chunk)."""
        return self.pp_rank == self.pp - 1

    @property
    def last_stage_rank(self) -> int:
        """The global rank of this rank's last pipeline stage (where the loss and the logprobs live)."""
        return dist.get_process_group_ranks(self.pp_group)[-1] if self.pp > 1 else self.rank


def init_process_group() -> tuple[int, int]:
    """Join (or start) the default group (``process_group_backend``) from torchrun's environment; world 1 without
    it."""
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group(backend=process_group_backend(torch.cuda.is_available()))
    return dist.get_rank(), dist.get_world_size()


def build_parallel_state(tp: int = 1, pp: int = 1, ep: int = 1, etp: int = 0,
                         sequence_parallel: bool = False, vpp: int = 1, cp: int = 1) -> ParallelState:
    """Initialise Megatron's model-parallel groups on the default group and describe them (etp 0: = tp;
    ``vpp`` > 1: that many virtual stages per pipeline rank, the interleaved schedule; ``cp``: context parallelism,
    world = tp × pp × cp × dp; ``dp``, ``dp_rank`` and ``dp_group`` are the data-parallel ones without CP, which
    split the batch's rows, while megatron reduces gradients over DP × CP itself)."""
    from megatron.core import parallel_state as mpu

    etp = etp or tp
    rank, world = init_process_group()
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not divisible by tp×pp×cp = {tp}×{pp}×{cp}")
    if vpp > 1 and pp == 1:
        raise ValueError(f"virtual pipeline stages ({vpp}) need pipeline parallelism (pp > 1)")
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            context_parallel_size=cp,
            create_gloo_process_groups=True,
        )
        if torch.cuda.is_available() and world > 1:
            # NCCL makes a group's communicator at its first operation, which every rank of the group must join when
            # that is a batched point-to-point (torch's batch_isend_irecv): the route exchange over DP, where a rank
            # with nothing to send skips it, would wait forever. One all-reduce over DP, every rank, makes it here.
            dist.all_reduce(torch.zeros(1, device="cuda"), group=mpu.get_data_parallel_group())
    return ParallelState(
        world_size=world,
        rank=rank,
        tp=tp,
        pp=pp,
        ep=ep,
        etp=etp,
        dp=world // (tp * pp * cp),
        vpp=vpp,
        sequence_parallel=sequence_parallel and tp > 1,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        ep_rank=mpu.get_expert_model_parallel_rank(),
        etp_rank=mpu.get_expert_tensor_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(),
        cp=cp,
        cp_rank=mpu.get_context_parallel_rank(),
        tp_group=mpu.get_tensor_model_parallel_group(),
        pp_group=mpu.get_pipeline_model_parallel_group(),
        dp_group=mpu.get_data_parallel_group(),
        ep_group=mpu.get_expert_model_parallel_group(),
        etp_group=mpu.get_expert_tensor_parallel_group(),
        cp_group=mpu.get_context_parallel_group(),
    )
