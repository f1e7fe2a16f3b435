"""The sync's wire: trainer sending ranks → every engine worker, one broadcast per bucket, over gloo or NCCL.

A group per trainer *sending rank* (``join_group``: a bare process group, unknown to ``torch.distributed``'s
helpers): the sender is rank 0 of its group, every worker of every replica joins every group (ranks 1..). A trainer
at TP=2 has one sender (the TP leader gathers each tensor); at PP=2 or EP=2 each stage / expert rank sends its own
layers over its own group, and nobody gathers the rest.

Wire format, per bucket of the plan (names + shapes + the sender's group, sent once ahead): a one-element flag
(1: a bucket follows; 0: that sender aborted and sends nothing more), then the bucket itself. ``GlooSender`` speaks
it on the trainer side, ``receive`` on the engine side (``vllm_backend``: vLLM's weight-transfer API); the next
bucket is on the wire while the current one loads. A group's timeout (``sync.timeout_s``) bounds every wait: a
trainer that dies mid-update cannot hang a replica forever.
"""

from __future__ import annotations

import math
import os
import socket
import time
from datetime import timedelta

import torch

from megarl.compat.torch import gloo_group_bound_to
from megarl.distributed.bootstrap import local_address_to


def listen(host: str = "127.0.0.1") -> socket.socket:
    """The bound, listening socket a group's rank 0 (a trainer sender) serves the group's store on."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen()
    return sock


def join_group(host: str, port: int, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 0.0,
               listen_socket: socket.socket | None = None):
    """A bare process group (unknown to ``torch.distributed``'s helpers): ``gloo`` or ``nccl``.

    Rank 0 passes its ``listen`` socket: it then serves the store itself even inside a torchrun
    job (whose ``TORCHELASTIC_USE_AGENT_STORE`` would otherwise make it a client of nobody)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    timeout = timedelta(seconds=timeout_s) if timeout_s > 0 else None
    if backend == "gloo" and not os.environ.get("GLOO_SOCKET_IFNAME"):  # (the user's interface choice wins)
        return gloo_group_bound_to(host if listen_socket is not None else local_address_to(host), host, port, rank,
                                  world_size, timeout, listen_socket)
    return stateless_init_torch_distributed_process_group(host, port, rank, world_size, backend=backend,
                                                          timeout=timeout, listen_socket=listen_socket)


def _post(group, numel: int, dtype: torch.dtype, device):
    """Start receiving the next (flag, bucket) pair of ``group``; returns them with their pending works."""
    flag, bucket = torch.zeros(1, dtype=torch.int64, device=device), torch.empty(numel, dtype=dtype, device=device)
    return flag, bucket, (group.broadcast(flag, 0), group.broadcast(bucket, 0))


class TransferAborted(RuntimeError):
    """A trainer sending rank aborted the update mid-way."""


def receive(groups: list, plan: list, sources: list[int], dtype: torch.dtype, device, load,
            timings: dict | None = None) -> int:
    """Receive every bucket of ``plan`` (bucket i from ``groups[sources[i]]``); ``load(i, views)`` each one.

    The next bucket is on the wire while ``load`` runs. A failure (a sender's abort, ``load``
    raising) is raised at the end, after every bucket the live senders send was received, so
    the senders and the other replicas go on. Returns the bytes received."""
    sizes = [sum(math.prod(s) for _, s in pieces) for pieces in plan]
    aborted: set[int] = set()
    failure, got = None, 0

    def post_from(i: int):
        while i < len(plan) and sources[i] in aborted:
            i += 1  # that sender sends nothing more
        return (i, _post(groups[sources[i]], sizes[i], dtype, device)) if i < len(plan) else (i, None)

    clock = time.perf_counter
    times = {"wait_s": 0.0, "load_s": 0.0} if timings is None else timings
    i, incoming = post_from(0)
    while incoming is not None:
        flag, bucket, works = incoming
        t = clock()
        for w in works:
            w.wait()
        times["wait_s"] = times.get("wait_s", 0.0) + clock() - t
        if int(flag) != 1:
            aborted.add(sources[i])
            failure = failure or TransferAborted(f"trainer sender {sources[i]} aborted the weight update")
            i, incoming = post_from(i + 1)
            continue
        got += bucket.nbytes
        current, (i, incoming) = i, post_from(i + 1)  # the next bucket arrives while this one loads
        if failure is not None:
            continue  # a local failure: keep receiving so the senders and the other replicas go on
        try:
            views, offset = [], 0
            for name, shape in plan[current]:
                n = math.prod(shape)
                views.append((name, bucket[offset:offset + n].view(tuple(shape))))
                offset += n
            t = clock()
            load(current, views)
            times["load_s"] = times.get("load_s", 0.0) + clock() - t
        except Exception as exc:  # noqa: BLE001  (raised below, after the stream ends)
            failure = exc
    if failure is not None:
        raise failure
    return got


def wire_device(backend: str) -> torch.device:
    """Where a transfer group's tensors live, sent and received: NCCL's on this process's GPU, gloo's (a CPU-only
    group) on the host."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class GlooSender:
    """A trainer sending rank's side: broadcast each of its buckets once to every replica's workers (rank 0 of its
    group).

    One bucket is on the wire while the next is filled; an abort sends the flag 0 with a bucket
    of the size the receivers expect next (so every posted receive completes) and then nothing."""

    def __init__(self, group, device=None) -> None:
        self.group, self.device = group, torch.device("cpu") if device is None else device

    def send(self, buckets, sizes: list[int], dtype: torch.dtype = torch.float32) -> int:
        """``buckets``: an iterator of this sender's flat tensors of ``sizes`` elements, in plan order; bytes sent.

        If the iterator or the link raises, the receivers are told to abort and the error is re-raised."""
        sent, posted, pending = 0, 0, ()
        one = torch.ones(1, dtype=torch.int64, device=self.device)
        try:
            for bucket in buckets:
                bucket = bucket.to(self.device)  # (gloo's group takes host tensors, NCCL's the GPU's)
                works = (self.group.broadcast(one, 0), self.group.broadcast(bucket, 0))
                for w in pending:
                    w.wait()
                pending, _held = works, bucket  # keep the bucket alive until it is on the wire
                posted, sent = posted + 1, sent + bucket.nbytes
            for w in pending:
                w.wait()
        except BaseException:
            try:
                for w in pending:
                    w.wait()
                if posted < len(sizes):
                    zero = torch.zeros(1, dtype=torch.int64, device=self.device)
                    self.group.broadcast(zero, 0).wait()
                    self.group.broadcast(torch.zeros(sizes[posted], dtype=dtype, device=self.device), 0).wait()
            except Exception:  # noqa: BLE001  (the link itself is broken: the caller ends the replicas)
                pass
            raise
        return sent
