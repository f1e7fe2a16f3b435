"""A trainer's Megatron shards gathered into full HF-named tensors on every rank: the plain reference the streamed
sync (``streaming``) is held equal to, and what tests compare engines against."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megarl.distributed.parallel import ParallelState
from megarl.models.hf_adapter import megatron_to_hf
from megarl.models.sharding import global_name, join_tp_shards, local_expert_name, tp_split_dim


def _merge_over(group, local: dict[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
    """Union of every rank's dict in ``group`` (pipeline stages or expert ranks hold disjoint names)."""
    if size == 1:
        return local
    parts: list = [None] * size
    dist.all_gather_object(parts, local, group=group)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


@torch.no_grad()
def gather_full_megatron(modules: list[torch.nn.Module], ps: ParallelState, num_layers: int,
                         num_experts: int) -> dict[str, torch.Tensor]:
    """Full tensors under global Megatron names, identical on every rank, on the host (``modules``: the model chunks;
    host copies: the exchange over expert ranks and stages pickles them, and a pickled CUDA tensor comes back on its
    sender's device)."""
    full: dict[str, torch.Tensor] = {}
    named = ((ps.coords(vp), local_expert_name(name), p)
             for vp, module in enumerate(modules) for name, p in module.named_parameters())
    for coords, name, p in named:
        t = p.detach()
        is_expert = ".experts." in name
        size = ps.etp if is_expert else ps.tp
        if size > 1 and tp_split_dim(name) is not None:
            group = ps.etp_group if is_expert else ps.tp_group
            shards = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(shards, t.contiguous(), group=group)
            t = join_tp_shards(name, shards)
        full[global_name(name, num_layers, num_experts, coords)] = t.to("cpu", copy=True)
    if ps.ep > 1:
        experts = {k: v for k, v in full.items() if ".experts." in k}
        full.update(_merge_over(ps.ep_group, experts, ps.ep))
    if ps.pp > 1:
        full = _merge_over(ps.pp_group, full, ps.pp)
    return full


def gather_hf_weights(modules: list[torch.nn.Module], hf_cfg: dict, ps: ParallelState,
                      num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    full = gather_full_megatron(modules, ps, hf_cfg["num_hidden_layers"], num_experts)
    return megatron_to_hf(sorted(full.items()), hf_cfg)
