"""Nodes that run only engine replicas (``engine.replica_nodes_dedicated``): the replica host on each of them.

::

    trainer node(s): torchrun → trainer ranks        engine node(s): python -m megarl.engines.remote.host
                                                     (no trainer rank)
      rank 0: HostPool ── Listener (a free port, a per-run authkey)
              └─ <run_dir>/engine_hosts.json  ◀── polled on the shared filesystem (0600; this job's tag)
                                   ◀─────────────── Client(address, authkey) → ("host", node, host name, pid)
              ("spawn", rank 0's replica rendezvous, [(k, spec), ...]) ──▶ ends its old replicas, spawns these
                                   ◀─────────────── ("spawned", {k: pid})
              replica k ◀── TCP (``nodes.serve_remote``: hello, then the same commands as any replica)
              link closed (rank 0 ends) ─────────────▶ the host kills its replicas and exits 0

With ``engine.replica_nodes: N`` and ``engine.replica_nodes_dedicated: true`` the allocation's last N nodes
run no trainer rank: ``slurm/train.sbatch`` starts torchrun on the first nodes and this host on the last N
(``python -m megarl.launch engine-nodes`` tells it N). Rank 0 alone drives the hosts: at start and at every
restart (``EngineReplicas.restart``) it sends each host the replica indices and specs to (re)spawn, over a
link that lives as long as the run. Host ``i`` (in node order) runs replicas ``i·R/N … (i+1)·R/N − 1``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Listener
from pathlib import Path

from megarl.config import ConfigError, load_config
from megarl.distributed.placement import available_cores, place_node
from megarl.engines.remote import reaper
from megarl.engines.remote.nodes import accept_within, serve_remote, waited
from megarl.logging.console import configure as configure_console

log = logging.getLogger("megarl.engines.remote.host")  # by name: run as `python -m`, __name__ is "__main__"


RENDEZVOUS_FILE = "engine_hosts.json"


def rendezvous_path(run_dir: str | Path) -> Path:
    """Where rank 0 publishes its host listener (the run directory: a filesystem every node shares)."""
    return Path(run_dir) / RENDEZVOUS_FILE


def job_tag() -> str:
    """This Slurm job and restart ('' outside Slurm): a host takes only its own job's rendezvous file."""
    job = os.environ.get("SLURM_JOB_ID", "")
    return f"{job}.{os.environ.get('SLURM_RESTART_COUNT', '0') or '0'}" if job else ""


def host_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def allocation_nodes() -> list[str]:
    """The allocation's node names in order ([] outside Slurm, or without ``scontrol``)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        return []
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.split()


def publish(path: Path, address: tuple[str, int], authkey: bytes) -> None:
    """Write the rendezvous file atomically, readable by this user only (it holds the run's secret)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"host": address[0], "port": address[1], "authkey": authkey.hex(), "job": job_tag()}, f)
    os.replace(tmp, path)


class HostPool:
    """Trainer rank 0's links to the replica hosts, one per dedicated engine node, in node order."""

    def __init__(self, path: Path, hosts: int, first_node: int, host: str, timeout_s: float) -> None:
        self.path, self.first_node = Path(path), first_node
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # a stale file (an earlier job) names a listener that is gone
        authkey = secrets.token_bytes(32)
        listener = Listener((host, 0), authkey=authkey)
        self.address = (host, listener.address[1])
        publish(self.path, self.address, authkey)
        try:
            self.links = self._accept(listener, hosts, timeout_s)  # [(conn, node, name, pid)], by node
        finally:
            listener.close()

    def _accept(self, listener, hosts: int, timeout_s: float) -> list[tuple]:
        def greet(conn):
            kind, node, name, pid = conn.recv()
            return (conn, node, name, pid) if kind == "host" else None

        got = accept_within(listener, self.address, hosts, timeout_s, greet, "megarl-host-rendezvous")
        expected = list(range(self.first_node, self.first_node + hosts))
        missing = sorted(set(expected) - {node for _, node, _, _ in got})
        if missing or len(got) != hosts:
            for conn, *_ in got:
                conn.close()
            self.path.unlink(missing_ok=True)
            names = allocation_nodes()
            named = ", ".join(f"{n} ({names[n]})" if n < len(names) else str(n) for n in missing)
            strays = sorted({n for _, n, _, _ in got} - set(expected))
            raise RuntimeError(f"engine replica host(s) of node(s) {named or expected} "
                               f"(engine.replica_nodes_dedicated: the allocation's last {hosts} node(s)) did not "
                               f"connect to trainer rank 0 at {self.address[0]}:{self.address[1]} (published in "
                               f"{self.path}) {waited(timeout_s)}; each engine node runs "
                               "`python -m megarl.engines.remote.host --config FILE [key=value ...]` "
                               "(slurm/train.sbatch starts it)"
                               + (f"; hosts that did link said nodes {sorted(n for _, n, _, _ in got)}" if got else "")
                               + (f"; node(s) {strays} are not engine-only nodes: valid --node values are "
                                  f"{expected[0]}..{expected[-1]} (the trainer's {self.first_node} node(s) come first)"
                                  if strays else ""))
        return sorted(got, key=lambda link: link[1])

    def where(self, i: int) -> str:
        _, node, name, pid = self.links[i]
        return f"replica host pid {pid} on node {node} ({name})"

    def spawn(self, rendezvous: tuple, shares: list[list[tuple[int, dict]]],
              timeout_s: float = 120.0) -> dict[int, int]:
        """Every host ends its old replicas and spawns its share (host i: ``shares[i]``, [(replica index, spec)]),
        which connect to ``rendezvous`` (``nodes.Rendezvous.address``); replica index → pid."""
        pids: dict[int, int] = {}
        for i, ((conn, *_), mine) in enumerate(zip(self.links, shares, strict=True)):
            try:
                conn.send(("spawn", (rendezvous, mine)))
            except OSError as exc:
                raise RuntimeError(f"{self.where(i)} is gone ({type(exc).__name__}: {exc})") from exc
        for i, (conn, *_) in enumerate(self.links):
            try:
                if not conn.poll(timeout_s):
                    raise RuntimeError(f"{self.where(i)} did not spawn its replicas within {timeout_s:.0f}s")
                status, detail = conn.recv()
            except (EOFError, OSError) as exc:
                raise RuntimeError(f"{self.where(i)} is gone ({type(exc).__name__})") from exc
            if status != "spawned":
                raise RuntimeError(f"{self.where(i)} could not spawn its replicas: {detail}")
            pids.update(detail)
        return pids

    def close(self) -> None:
        """End the links: every host kills its replicas and exits 0."""
        for conn, *_ in self.links:
            conn.close()
        self.links = []
        self.path.unlink(missing_ok=True)


def connect(path: Path, wait_s: float):
    """The host's side: poll ``path`` for this job's rendezvous, connect with its secret (retrying a refused,
    stale or half-written one); the link and whom it reached (address, job tag)."""
    deadline, last = time.monotonic() + wait_s, ""
    while True:
        try:
            info = json.loads(path.read_text())
            if not (info.get("job") and job_tag()) or info["job"] == job_tag():
                conn = Client((info["host"], int(info["port"])), authkey=bytes.fromhex(info["authkey"]))
                return conn, f"{info['host']}:{info['port']}" + (f" (job {info['job']})" if info.get("job") else "")
            last = f"{path} is job {info['job']}'s, not this job's ({job_tag()})"
        except FileNotFoundError:
            last = f"{path} does not exist yet"
        except (OSError, ValueError, KeyError, EOFError, AuthenticationError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline:
            raise TimeoutError(f"trainer rank 0 did not publish a reachable rendezvous in {path} within "
                               f"{wait_s:.0f}s (last: {last})")
        time.sleep(0.5)


def _end(procs: dict, grace_s: float = 10.0) -> None:
    """End the replicas (each also ends itself when rank 0 closes its link: wait ``grace_s`` for that)."""
    deadline = time.monotonic() + grace_s
    for proc in procs.values():
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            reaper.kill_tree(proc.pid)  # with its vLLM workers
            proc.join(5)
    procs.clear()
    reaper.unlink_orphans()  # the rings a killed replica's engine could not unlink


PREEMPTION = (signal.SIGTERM, signal.SIGUSR1)  # Slurm sends them to every process of the job; rank 0 acts on them
_linked = False  # serving trainer rank 0 (SIGTERM then waits for its link to end)
_noticed = False  # the SIGTERM was logged once


def _on_sigterm(signum, frame) -> None:
    """Unlinked (scancel, the batch script's kill): exit 143, ending the replicas. Linked: Slurm's preemption
    notice (or scancel) reached every process of the job; trainer rank 0 saves its checkpoint first and then ends
    the link, which ends this host (killed rank 0 → the link ends too)."""
    global _noticed
    if not _linked:
        sys.exit(143)
    if _noticed:  # Slurm repeats it (at the end of GraceTime, then before its SIGKILL)
        return
    _noticed = True
    log.info("megarl: replica host: SIGTERM while linked to trainer rank 0: serving on until rank 0 (which checkpoints "
             "first) ends its link")


def serve_host(conn, node: int, name: str) -> None:
    """Spawn and end replicas as rank 0 says, until its link ends; then end them all."""
    import multiprocessing as mp

    ctx, procs = mp.get_context("spawn"), {}
    try:
        while True:
            try:
                cmd, arg = conn.recv()
            except (EOFError, OSError):
                log.info(f"megarl: replica host on node {node} ({name}): trainer rank 0's link ended; ending replicas "
                         f"{sorted(procs)}")
                _end(procs, grace_s=0.0)
                return
            if cmd != "spawn":
                conn.send(("error", f"unknown command {cmd!r}"))
                continue
            rendezvous, jobs = arg
            place_replicas(jobs)
            ended = {k: p.exitcode for k, p in procs.items() if not p.is_alive()}  # before rank 0's word
            killed = sorted(set(procs) - set(ended))
            _end(procs)
            try:
                for k, spec in jobs:
                    procs[k] = ctx.Process(target=serve_remote, args=(rendezvous, k, node, spec),
                                           name=f"megarl-engine-{k}")
                    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in PREEMPTION}  # the replica
                    try:  # inherits them ignored (a block is not inherited for sure: multiprocessing may lift it)
                        procs[k].start()
                    finally:
                        for sig, handler in handlers.items():
                            signal.signal(sig, handler)
            except Exception as exc:  # noqa: BLE001  (reported to rank 0, which names this host)
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
                continue
            pids = {k: p.pid for k, p in procs.items()}
            log.info(f"megarl: replica host on node {node} ({name}): spawned replicas {pids} (index: pid)"
                     + (f"; the previous ones had exited with {ended}" if ended else "")
                     + (f"; ended {killed} at rank 0's word" if killed else ""))
            conn.send(("spawned", pids))
    finally:
        _end(procs)


def place_replicas(jobs: list[tuple[int, dict]]) -> None:
    """An engine-only node's cores split between the replicas it runs (their specs' ``cpus``; ``engine.cpu_threads``
    per worker, 0: an even share), which run at once (``distributed.placement``)."""
    threads = jobs[0][1].get("cpu_threads", 0) if jobs else 0
    shares = place_node(available_cores(), 0, [spec["tp"] for _, spec in jobs], False, 0, threads).replicas
    for (_, spec), share in zip(jobs, shares):
        spec["cpus"] = [(c.threads, c.cores) for c in share]


def node_of(name: str) -> int:
    """This node's index in the Slurm allocation (its position in ``SLURM_JOB_NODELIST``)."""
    names = allocation_nodes()
    if not names:  # outside Slurm (torchrun on each machine by hand): the user numbers the nodes
        raise RuntimeError("cannot tell this node's index outside Slurm (no SLURM_JOB_NODELIST); pass --node N: "
                           "the trainer's node count (torchrun's --nnodes) for the first engine-only node, +1 for "
                           "each further one")
    if name not in names:
        raise RuntimeError(f"cannot tell this node's index: {name!r} is not in SLURM_JOB_NODELIST "
                           f"{os.environ.get('SLURM_JOB_NODELIST', '')!r}; pass --node N")
    return names.index(name)


def main(argv: list[str] | None = None) -> int:
    configure_console()
    ap = argparse.ArgumentParser(prog="python -m megarl.engines.remote.host",
                                 description="Run the engine replicas of one dedicated engine node for trainer rank 0.")
    ap.add_argument("--config")
    ap.add_argument("--node", type=int, help="this node's index in the allocation (default: from Slurm)")
    ap.add_argument("--wait-s", type=float, default=3600.0, help="how long to wait for trainer rank 0's rendezvous")
    ap.add_argument("overrides", nargs="*")
    args, _ = ap.parse_known_intermixed_args(argv)  # other `megarl train` options (--nproc) are not ours
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"megarl: config error: {exc}", file=sys.stderr)
        return 2
    if not cfg.engine.replica_nodes_dedicated:
        print("megarl: config error: a replica host serves engine.replica_nodes_dedicated=true runs; this config "
              "has engine.replica_nodes_dedicated=false (its replicas are spawned by trainer ranks)", file=sys.stderr)
        return 2
    global _linked
    signal.signal(signal.SIGTERM, _on_sigterm)
    name = host_name()
    try:
        node = args.node if args.node is not None else node_of(name)
    except RuntimeError as exc:
        print(f"megarl: replica host on {name}: {exc}", file=sys.stderr)
        return 2
    path = rendezvous_path(cfg.train.run_dir)
    log.info(f"megarl: replica host on node {node} ({name}), pid {os.getpid()}: waiting for trainer rank 0 in {path}")
    conn, rank0 = connect(path, args.wait_s)
    conn.send(("host", node, name, os.getpid()))
    _linked = True
    log.info(f"megarl: replica host on node {node} ({name}): linked to trainer rank 0 at {rank0}")
    serve_host(conn, node, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
