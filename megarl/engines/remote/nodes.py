"""Disaggregated replicas on nodes other than rank 0's (``engine.replica_nodes``): where each one runs, and its
link home.

::

    node 0: trainer rank 0 (leader) ── Listener (rank 0's host, a free port, a per-run authkey)
              ▲  ▲        (address + authkey: broadcast over the trainer's process group)
              │  └──────────────────────────────────────────────┐
    node 1: its first trainer rank spawns replicas 0, 1 ──────── each: Client((host, port), authkey)
              (joins/kills them at restart and exit)              → hello (index, pid, node, host name)
                                                                  → serve(conn, spec): the same commands
                                                                    as a replica on rank 0's node (a pipe)

With ``engine.replica_nodes: N`` the job's last N nodes host the replicas, ``engine.replicas / N``
each, spawned by the node's first trainer rank (its node-local leader); ``engine.replica_devices``
then names each hosting node's devices. ``N = 0`` (the default): every replica on rank 0's node,
spawned by rank 0 over pipes, as before. A node is torchrun's ``GROUP_RANK``; without torchrun,
``rank // LOCAL_WORLD_SIZE`` (the launchers place ranks node by node).

Liveness without a process handle: rank 0 sees a remote replica's death as the end of its
connection (``RemoteProcess.is_alive`` peeks without reading), so a lost replica is the same
contained ``EngineDied``; and a replica ends itself when rank 0 closes its connection
(``RemoteProcess.kill``), even mid-broadcast. Restarts are collective: every trainer rank calls
``EngineReplicas.restart``, the hosting leaders end and respawn their own processes.
With ``engine.replica_nodes_dedicated`` those nodes run no trainer rank: a replica host there
(``host.py``) spawns them with ``serve_remote`` on rank 0's word, and rank 0 alone restarts them.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from multiprocessing.connection import Client, Listener

from megarl.config.validate.layout import check_replica_nodes_fit, check_replica_share
from megarl.distributed.bootstrap import local_address_to
from megarl.distributed.signals import signalled
from megarl.engines.remote.process import serve

log = logging.getLogger(__name__)


def node_index(rank: int) -> int:
    """This trainer process's node in the job (torchrun's GROUP_RANK, else rank // LOCAL_WORLD_SIZE)."""
    if os.environ.get("GROUP_RANK", "") != "":
        return int(os.environ["GROUP_RANK"])
    return rank // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def place(replicas: int, replica_nodes: int, nodes_of_ranks: list[int]) -> dict[int, list[int]]:
    """trainer rank → the replica indices it spawns: rank 0 all of them (``replica_nodes=0``), else the first
    rank of each of the job's last ``replica_nodes`` nodes ``replicas / replica_nodes`` of them, in node order."""
    if replica_nodes == 0:
        return {0: list(range(replicas))}
    nodes = sorted(set(nodes_of_ranks))
    # megarl train checks this before launch from the job's shape (config.loader.check_replica_nodes_fit, called by
    # launch.plan.check_layout); here on the nodes the ranks really landed on
    check_replica_nodes_fit(replicas, replica_nodes, len(nodes), len(nodes_of_ranks))
    leaders = [nodes_of_ranks.index(n) for n in nodes[len(nodes) - replica_nodes:]]
    return dict(zip(leaders, shares(replicas, replica_nodes)))


def shares(replicas: int, hosting_nodes: int) -> list[list[int]]:
    """The replica indices each hosting node runs, in node order: equal consecutive shares."""
    check_replica_share(replicas, hosting_nodes)
    per = replicas // hosting_nodes
    return [list(range(i * per, (i + 1) * per)) for i in range(hosting_nodes)]


def reachable_host(hosts: list[str], elsewhere: bool = False) -> str:
    """The address other nodes reach this one at: loopback when every trainer rank (``hosts``: their host
    names) is on one host and no replica runs ``elsewhere`` (on engine-only nodes), else ``node_address()``."""
    return "127.0.0.1" if len(set(hosts)) == 1 and not elsewhere else node_address()


def node_address() -> str:
    """This host's address for other nodes: ``$MEGARL_NODE_ADDR`` if set (a cluster with several networks),
    else its name's address, unless that is loopback (Debian maps the host name to 127.0.1.1) or the name does
    not resolve, then the address of the interface that carries the default route."""
    if os.environ.get("MEGARL_NODE_ADDR"):
        return os.environ["MEGARL_NODE_ADDR"]
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:  # a host name that resolves nowhere (no /etc/hosts line, no DNS): the route decides
        addr = "127.0.0.1"
    if not addr.startswith("127."):
        return addr
    return local_address_to("10.254.254.254", fallback=addr)



class RemoteProcess:
    """Rank 0's stand-in for a replica process another node spawned: alive while its connection is open."""

    def __init__(self, conn, pid: int, node: int, host: str) -> None:
        self.conn, self.pid, self.node, self.host = conn, pid, node, host
        self.exitcode = None  # known to the hosting node only
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))  # to peek at the link without reading it
        self._gone = False

    def is_alive(self) -> bool:
        if self._gone:
            return False
        try:
            self._gone = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""  # b"": the end
        except BlockingIOError:  # nothing to read: the link is open
            return True
        except OSError:
            self._gone = True
        return not self._gone

    def kill(self) -> None:
        """End the link; the replica ends itself when it sees that (``serve_remote``)."""
        self._gone = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self.conn.close()

    def join(self, timeout: float | None = None) -> None:
        """Wait (at most ``timeout``) until the link ends; the hosting node reaps the process itself."""
        end = time.monotonic() + (timeout or 0.0)
        while self.is_alive() and time.monotonic() < end:
            time.sleep(0.05)

    def __repr__(self) -> str:
        return f"pid {self.pid} on node {self.node} ({self.host})"


def where(proc) -> str:
    """A replica process for messages: its pid, and its node when another node spawned it."""
    return repr(proc) if isinstance(proc, RemoteProcess) else f"pid {proc.pid}"


def accept_within(listener, address: tuple, count: int, timeout_s: float, greet, name: str) -> list:
    """Accept links on ``listener`` (listening at ``address``) until ``count`` of them greeted or ``timeout_s``
    passed, then close it: what ``greet(conn)`` returned for each (None: a link to drop, not counted).

    The accepting runs in a thread: a stray or failed handshake (``AuthenticationError`` included) is skipped,
    and at the deadline a connection of our own wakes the blocked ``accept`` (closing the listener would not).
    The wait says how far it got every minute, and a preemption signal ends it (the callers' errors then say so,
    ``waited``): Slurm's SIGTERM went unheeded for the whole timeout, then the job was killed."""
    got: list = []
    stop = threading.Event()

    def run() -> None:
        while len(got) < count and not stop.is_set():
            try:
                kept = greet(listener.accept())
            except Exception:  # noqa: BLE001  (a stray or failed handshake; our wake-up)
                continue
            if kept is not None:
                got.append(kept)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    start, note_at = time.monotonic(), 60.0
    while thread.is_alive() and time.monotonic() - start < timeout_s and not signalled():
        thread.join(min(1.0, timeout_s - (time.monotonic() - start)))
        elapsed = time.monotonic() - start
        if thread.is_alive() and elapsed >= note_at:
            note_at += 60.0
            log.info(f"megarl: {name}: {len(got)} of {count} connected after {elapsed:.0f}s (waiting up to "
                     f"{timeout_s:.0f}s)")
    stop.set()
    if thread.is_alive():
        try:
            socket.create_connection(address, timeout=5).close()
        except OSError:
            pass
        thread.join(10)
    listener.close()
    return got


def waited(timeout_s: float) -> str:
    """How an ``accept_within`` wait ended short, for the caller's error."""
    return f"before {signalled()} (preemption) ended the wait" if signalled() else f"within {timeout_s:.0f}s"


class Rendezvous:
    """Rank 0's listener for the replicas that other nodes spawn."""

    def __init__(self, host: str) -> None:
        self.authkey = secrets.token_bytes(32)
        self.listener = Listener((host, 0), authkey=self.authkey)
        self.address = (host, self.listener.address[1], self.authkey)

    def accept(self, indices: list[int], timeout_s: float) -> dict[int, tuple]:
        """replica index → (conn, RemoteProcess) for each of ``indices``, within ``timeout_s``; then closes."""

        def greet(conn):
            index, pid, node, host = conn.recv()
            return index, (conn, RemoteProcess(conn, pid, node, host))

        got = dict(accept_within(self.listener, self.address[:2], len(indices), timeout_s, greet,
                                 "megarl-replica-rendezvous"))
        missing = sorted(set(indices) - set(got))
        if missing:
            for _, proc in got.values():  # those that came end themselves
                proc.kill()
            raise RuntimeError(f"engine replicas {missing} (on other nodes) did not connect to trainer rank 0 at "
                               f"{self.address[0]}:{self.address[1]} {waited(timeout_s)}")
        return got


def _follow_the_trainer(conn) -> None:
    """End this process as soon as rank 0 closes the link (it may be blocked in a transfer group)."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    while True:
        try:
            if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                os._exit(1)
        except BlockingIOError:
            pass
        except OSError:
            os._exit(1)
        time.sleep(0.2)


def serve_remote(address: tuple, index: int, node: int, spec: dict) -> None:
    """A replica spawned on another node: connect to rank 0, say who it is, then serve like any replica."""
    host, port, authkey = address
    conn = Client((host, port), authkey=authkey)
    conn.send((index, os.getpid(), node, os.environ.get("SLURMD_NODENAME") or socket.gethostname()))
    threading.Thread(target=_follow_the_trainer, args=(conn,), name="megarl-follow-trainer", daemon=True).start()
    serve(conn, spec)
