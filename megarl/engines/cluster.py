"""Disaggregated engines with several trainer processes: rank 0 drives the replicas, every rank learns the results.

::

    rank 0 (leader)                        rank r > 0
      controller.run_phase ─▶ replicas       (no replica handles)
      (groups, metrics) ──broadcast_object──▶ the same (groups, metrics): it trains on them
      engine error ──────broadcast_object──▶ the same error: every rank's RunKeeper restarts + resyncs
    sync: every rank walks the plan (TP gathers onto the sender), and the rank that owns a bucket
          sends it to the replicas itself (``own_buckets``): pipeline stages and expert ranks send their
          own layers; nobody gathers the rest.

With one trainer process every call here is the plain one (no collective).
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from megarl.rollout.controller import RolloutController


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


def gather(obj) -> list:
    """Every trainer rank's ``obj``, in rank order."""
    if rank_and_world()[1] == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def sender_socket(sends: bool, elsewhere: bool = False):
    """This rank's transfer group's (host, port) and listening socket if it ``sends``, else None (collective):
    loopback when the whole run is on one host (not when the replicas run ``elsewhere``, on engine-only nodes)."""
    from megarl.engines.gloo_transfer import listen
    from megarl.engines.nodes import reachable_host

    hosts = gather(socket.gethostname())
    if not sends:
        return None
    host = reachable_host(hosts, elsewhere)
    sock = listen(host)
    return host, sock.getsockname()[1], sock


@torch.no_grad()
def own_buckets(sync):
    """A ``StreamingSync``'s buckets that this rank sends, filled in plan order (collective over TP groups).

    Every rank walks every bucket so that the TP gathers of the owner's tensors happen; it
    keeps only the buckets it owns — no broadcast inside the trainer, no rank holds another's."""
    from megarl.weight_sync.streaming import SyncStats

    rank, sync.stats = dist.get_rank(), SyncStats()
    empty = torch.empty(0, dtype=sync.dtype)
    for entries in sync.buckets():
        total = sum(e.numel for e in entries)
        mine = entries[0].source == rank
        bucket = torch.empty(total, dtype=sync.dtype, device=sync._device) if mine else empty
        offset = 0
        for e in entries:
            if e.name in sync._local:
                extra = sync._fill(e, bucket[offset:offset + e.numel] if mine else empty)
                sync.stats.peak_extra_bytes = max(sync.stats.peak_extra_bytes, bucket.nbytes + extra)
            offset += e.numel
        sync.stats.bytes += total * empty.element_size()
        sync.stats.buckets += 1
        if mine:
            yield bucket


class LeaderController(RolloutController):
    """The SortedRL controller on rank 0, whose phases every trainer rank receives (see the module docstring)."""

    def run_phase(self, version: int):
        rank, world = rank_and_world()
        if world == 1:
            return super().run_phase(version)
        payload = None
        if rank == 0:
            try:
                payload = ("ok", super().run_phase(version))
            except Exception as exc:  # noqa: BLE001  (every rank raises it: the keeper's containment)
                share(("error", f"{type(exc).__name__}: {exc}"))
                raise
        payload = share(payload)
        if payload[0] == "error":
            from megarl.engines.replica_client import EngineDied

            raise EngineDied(f"on trainer rank 0: {payload[1]}")
        return payload[1]
