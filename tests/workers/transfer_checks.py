"""Our weight-transfer wire format between processes, without an engine: two trainer senders, two receivers.

    python tests/workers/transfer_checks.py gloo|nccl [abort]

Each sender opens its own group (``join_group``, vLLM's stateless init) that both receivers
join; the plan interleaves the senders' buckets (as pipeline stages with virtual stages do).
With ``abort`` sender 1's iterator raises after its first bucket: both receivers still get every
bucket of sender 0, then raise ``TransferAborted``. Prints one JSON line.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys

import torch

PLAN_SOURCES = [0, 1, 0, 1, 1, 0]
SIZES = [5, 7, 3, 11, 2, 13]


def bucket(i: int, device) -> torch.Tensor:
    return torch.arange(SIZES[i], dtype=torch.float32, device=device) + 100 * i


def _device(backend: str, rank: int):
    if backend != "nccl":
        return torch.device("cpu")
    torch.cuda.set_device(rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def sender(index: int, backend: str, abort: bool, ports, out) -> None:
    from megarl.weight_sync.transport import GlooSender, join_group, listen

    device = _device(backend, index)
    sock = listen()
    port = sock.getsockname()[1]
    ports.put((index, port))
    group = join_group("127.0.0.1", port, 0, 3, backend, 60, listen_socket=sock)
    mine = [i for i, s in enumerate(PLAN_SOURCES) if s == index]

    def buckets():
        for n, i in enumerate(mine):
            if abort and index == 1 and n == 1:
                raise ConnectionError("injected: sender 1 fails after its first bucket")
            yield bucket(i, device)

    try:
        out.put(("sender", index, GlooSender(group, device).send(buckets(), [SIZES[i] for i in mine]), ""))
    except ConnectionError as exc:
        out.put(("sender", index, 0, str(exc)))


def receiver(index: int, ports: list[int], backend: str, out) -> None:
    from megarl.weight_sync.transport import join_group, receive

    device = _device(backend, 2 + index)
    groups = [join_group("127.0.0.1", port, 1 + index, 3, backend, 60) for port in ports]
    plan = [[(f"b{i}", (n,))] for i, n in enumerate(SIZES)]
    got = {}

    def load(i, views):
        (_, view), = views
        got[i] = bool(torch.equal(view, bucket(i, device)))

    try:
        received, error = receive(groups, plan, PLAN_SOURCES, torch.float32, device, load), ""
    except Exception as exc:  # noqa: BLE001  (reported)
        received, error = 0, f"{type(exc).__name__}: {exc}"
    out.put(("receiver", index, received, error, got))


def main(backend: str, *flags: str) -> None:
    abort = "abort" in flags
    ctx = mp.get_context("spawn")
    out, opened = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=sender, args=(k, backend, abort, opened, out)) for k in range(2)]
    for p in procs:
        p.start()
    ports = [port for _, port in sorted(opened.get(timeout=300) for _ in range(2))]
    procs += [ctx.Process(target=receiver, args=(k, ports, backend, out)) for k in range(2)]
    for p in procs[2:]:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
    senders = {r[1]: {"sent": r[2], "error": r[3]} for r in results if r[0] == "sender"}
    receivers = {r[1]: {"received": r[2], "error": r[3], "equal": r[4]} for r in results if r[0] == "receiver"}
    print(json.dumps({"senders": senders, "receivers": receivers, "exit": [p.exitcode for p in procs]}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    main(*sys.argv[1:])
