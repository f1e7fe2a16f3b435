"""LoRA adapters of a trainer (megarl/trainer/lora.py) in one process's layout, for comparison across layouts: each
adapter tensor under its global name, its TP shards joined, every pipeline stage's merged, and its gradient as the
step's reduction left it over data parallelism."""

from __future__ import annotations

import torch


def sharded(name: str, adapter) -> bool:
    """Whether this adapter tensor is split over TP as its base weight is (column B, row A)."""
    return name.endswith(".lora.a") == adapter.row


def whole(name: str, t: torch.Tensor, adapter, ps) -> torch.Tensor:
    """The tensor as one process holds it: a split one's TP shards joined as the base weight's are."""
    import torch.distributed as dist

    from megarl.models.sharding import join_tp_shards

    if adapter.tp == 1 or not sharded(name, adapter):  # (an expert's adapter: expert TP 1, never split)
        return t
    shards = [torch.empty_like(t) for _ in range(adapter.tp)]
    dist.all_gather(shards, t.contiguous(), group=adapter.tp_group)
    return join_tp_shards(name.rsplit(".lora.", 1)[0] + ".weight", shards)


def adapter_params(trainer) -> list[tuple[str, str, torch.nn.Parameter, object]]:
    """This rank's adapter tensors: (global name, name in its model chunk, parameter, its ``LoraAdapter``). Global as
    ``weight_sync.gather.gather_full_megatron`` names them: layer numbers over pipeline (and virtual) stages."""
    from megarl.models.hf_config import num_experts
    from megarl.models.sharding import global_name

    cfg, ps, out = trainer.hf_cfg, trainer.ps, []
    for vp, module in enumerate(trainer.modules):
        owner = {f"{name}.lora.{w}": m.lora for name, m in module.named_modules() if hasattr(m, "lora") for w in "ab"}
        for name, p in module.named_parameters():
            if name in owner:
                full = global_name(name, cfg["num_hidden_layers"], num_experts(cfg), ps.coords(vp))
                out.append((full, name, p, owner[name]))
    return out


@torch.no_grad()
def reduced_everywhere(trainer) -> None:
    """Every gradient buffer holding the step's reduced gradient on every DP rank. The distributed optimizer's
    reduce-scatter leaves each rank the reduced (DP-averaged) gradient of its own shard of each bucket only, the
    rest of the buffer the rank's own unreduced one: the reduced shards are gathered back in place, so each
    ``main_grad`` is the gradient the optimizer steps with. The non-distributed optimizer's all-reduce already left
    it whole (nothing to do)."""
    import torch.distributed as dist
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for chunk in trainer.chunks:
        if not chunk.ddp_config.use_distributed_optimizer:
            continue
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            size = group.intra_distributed_optimizer_instance_size
            for bucket in group.buckets if size > 1 else ():
                shards = shard_buffer(bucket.grad_data, size)
                got = [torch.empty_like(shards[0]) for _ in range(size)]
                dist.all_gather(got, shards[group.intra_distributed_optimizer_instance_rank].clone(),
                                group=group.intra_distributed_optimizer_instance_group)
                for shard, reduced in zip(shards, got):
                    shard.copy_(reduced)


def gathered_grads(trainer) -> dict[str, list]:
    """Every adapter's gradient (``main_grad``, reduced over DP: ``reduced_everywhere`` first) as one process holds
    it, by global name, on every rank: TP shards joined, every EP rank's experts and pipeline stage's merged."""
    ps = trainer.ps
    return merged({full: whole(name, p.main_grad, adapter, ps).tolist()
                   for full, name, p, adapter in adapter_params(trainer)}, ps)


def merged(mine: dict, ps) -> dict:
    """This rank's tensors by global name with every EP rank's (its experts) and pipeline stage's, on every rank."""
    from megarl.distributed.collectives import gather

    for group, size in ((ps.ep_group, ps.ep), (ps.pp_group, ps.pp)):
        if size > 1:
            mine = {k: v for part in gather(mine, group) for k, v in part.items()}
    return mine
