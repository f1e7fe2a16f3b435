"""Small collectives over the trainer's default group; each is the plain value with one process.

Every rank calls a collective at the same point: ``any_rank`` (a flag of any rank, one all-reduce), ``share``
(rank 0's object), ``gather`` (every rank's object).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def share(obj, src: int = 0):
    """``obj`` of rank ``src`` on every trainer rank (itself with one process)."""
    if rank_and_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def any_rank(flag: bool, group=None, timeout_s: float | None = None) -> bool:
    """``flag`` of any rank of ``group`` (default: every trainer rank), on each of them: one all-reduce, so every
    rank calls it at the same point; the plain ``flag`` with one process. ``timeout_s``: raise when the other
    ranks have not joined the all-reduce by then (gloo: "Operation timed out!")."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0])
    if timeout_s is None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    else:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True).wait(timeout=timedelta(seconds=timeout_s))
    return bool(t.item())


def gather(obj, group=None) -> list:
    """Every rank's ``obj`` of ``group`` (default: every trainer rank), in rank order."""
    if rank_and_world()[1] == 1 or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
