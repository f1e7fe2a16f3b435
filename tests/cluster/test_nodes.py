"""Disaggregated replicas on nodes other than rank 0's (``engine.replica_nodes``, ``megarl/engines/remote/nodes.py``).

Default run (fast): which trainer rank spawns which replica and the errors for a placement the job
cannot hold; the link a remote replica keeps to rank 0 over real TCP sockets with real processes
(authkey handshake, a stranger refused, death seen as the link's end, a replica that ends itself
when rank 0 drops it, a replica that never connects named in the error).
Slow: two torchrun "nodes" on this host (``--nnodes 2 --node-rank``) with both replicas on node 1:
the cluster checks (each pipeline stage sends its own layers, logprobs equal, a replica killed
mid-broadcast, the keeper's restart respawns them on node 1); and a real two-node Slurm job
(``slurm/train.sbatch``) training end to end with the replicas spawned under node 1's step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.processes import wait_until
from helpers.scripts import ROOT

CHILD = """
import os, sys, threading
from multiprocessing.connection import Client
from megarl.engines.remote import nodes
host, port, key, index = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3]), int(sys.argv[4])
conn = Client((host, port), authkey=key)
conn.send((index, os.getpid(), 1, "n2"))
threading.Thread(target=nodes._follow_the_trainer, args=(conn,), daemon=True).start()
while True:
    conn.send(("echo", conn.recv()))
"""


def test_placement_spawners_and_errors_naming_the_key():
    from megarl.config import load_config, validate
    from megarl.config.loader import ConfigError
    from megarl.engines.remote.nodes import place

    assert place(2, 0, [0, 0, 1, 1]) == {0: [0, 1]}  # default: every replica on rank 0's node
    assert place(2, 1, [0, 0, 1, 1]) == {2: [0, 1]}  # the last node's first rank spawns both
    assert place(4, 2, [0, 0, 1, 1]) == {0: [0, 1], 2: [2, 3]}
    assert place(3, 3, [0, 1, 2]) == {0: [0], 1: [1], 2: [2]}
    with pytest.raises(ConfigError, match=r"engine.replica_nodes=3: the job has 2 node\(s\) \(4 trainer processes\); "
                                          r"valid: \[0, 1, 2\] \(0: rank 0's node"):
        place(2, 3, [0, 0, 1, 1])
    base = ["engine.placement=disaggregated", "engine.replicas=2"]
    with pytest.raises(ConfigError, match=r"engine.replica_nodes=3 must divide engine.replicas=2"):
        validate(load_config("configs/demo.yaml", [*base, "engine.replica_nodes=3"]), 2)
    with pytest.raises(ConfigError, match=r"engine.replica_nodes must be >= 0 .* got -1"):
        validate(load_config("configs/demo.yaml", [*base, "engine.replica_nodes=-1"]), 2)
    with pytest.raises(ConfigError, match=r"engine.replica_nodes=1 places disaggregated replicas; set "
                                          r"engine.placement=disaggregated"):
        validate(load_config("configs/demo.yaml", ["engine.replica_nodes=1"]), 2)
    validate(load_config("configs/demo.yaml", [*base, "engine.replica_nodes=2"]), 2)


def test_the_address_other_nodes_reach_never_loopback_when_replicas_run_elsewhere(monkeypatch):
    """Loopback only when every trainer rank is on one host and no replica runs on an engine-only node; else the
    host's address, never a loopback one while a route exists (Debian maps the host name to 127.0.1.1), and
    $MEGARL_NODE_ADDR where the cluster says which network."""
    import socket

    from megarl.engines.remote.nodes import node_address, reachable_host

    monkeypatch.delenv("MEGARL_NODE_ADDR", raising=False)
    assert reachable_host(["n1", "n1"]) == "127.0.0.1"
    addr = node_address()
    assert reachable_host(["n1", "n2"]) == addr and reachable_host(["n1"], elsewhere=True) == addr
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # a machine with a route: never loopback
        try:
            probe.connect(("10.254.254.254", 9))
            routed = True
        except OSError:
            routed = False
    assert not addr.startswith("127.") or not routed, addr
    with socket.create_server((addr, 0)) as server:  # it is this host's own: rank 0 can listen on it
        assert server.getsockname()[0] == addr
    monkeypatch.setenv("MEGARL_NODE_ADDR", "10.1.2.3")
    assert reachable_host(["n1"], elsewhere=True) == "10.1.2.3" and reachable_host(["n1", "n1"]) == "127.0.0.1"


def _child(address, index: int, key: bytes | None = None) -> subprocess.Popen:
    host, port, authkey = address
    return subprocess.Popen([sys.executable, "-c", CHILD, host, str(port), (key or authkey).hex(), str(index)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.DEVNULL)


def test_remote_replica_links_handshake_liveness_and_ending():
    from megarl.engines.remote.nodes import RemoteProcess, Rendezvous

    rv = Rendezvous("127.0.0.1")
    stranger = _child(rv.address, 7, key=b"not the run's secret")
    kids = [_child(rv.address, k) for k in (0, 1)]
    try:
        links = rv.accept([0, 1], 60)
        assert sorted(links) == [0, 1]  # the stranger (wrong authkey) was refused, not counted
        assert stranger.wait(30) != 0
        for k, kid in enumerate(kids):
            conn, proc = links[k]
            assert isinstance(proc, RemoteProcess) and (proc.pid, proc.node, proc.host) == (kid.pid, 1, "n2")
            conn.send(("step", k))
            assert conn.poll(10) and proc.is_alive()  # a reply waiting to be read is no sign of death
            assert conn.recv() == ("echo", ("step", k)) and proc.is_alive()
        os.kill(kids[0].pid, signal.SIGKILL)  # a replica dies: its link ends, seen without reading from it
        assert wait_until(lambda: not links[0][1].is_alive()) and "node 1 (n2)" in repr(links[0][1])
        with pytest.raises(EOFError):
            links[0][0].recv()
        links[1][1].kill()  # rank 0 drops a replica (it may be blocked in a transfer group): it ends itself
        assert kids[1].wait(10) == 1 and not links[1][1].is_alive()
    finally:
        for kid in (stranger, *kids):
            if kid.poll() is None:
                kid.kill()
            kid.wait()
    late = Rendezvous("127.0.0.1")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"engine replicas \[3\] \(on other nodes\) did not connect to "
                                           r"trainer rank 0 at 127.0.0.1:\d+ within 1s"):
        late.accept([3], 1)
    assert time.monotonic() - start < 15


def test_a_preemption_signal_ends_the_wait_for_other_nodes(monkeypatch, capsys):
    """SIGTERM while rank 0 waits for replicas (or engine hosts) on other nodes: the wait went on for its whole
    timeout (600 s by default) in silence, and Slurm then killed the job; it now ends within a second, saying why."""
    from megarl.distributed import signals
    from megarl.engines.remote.nodes import Rendezvous

    monkeypatch.setattr(signals, "_signalled", "SIGTERM")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"engine replicas \[3\] .* before SIGTERM \(preemption\) ended the wait"):
        Rendezvous("127.0.0.1").accept([3], 600)
    assert time.monotonic() - start < 15


def _torchrun_nodes(tmp_path, script: list[str], timeout: int) -> list[str]:
    """Two torchrun agents on this host as the job's two nodes (1 trainer process each); their stdout."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                               f"--node-rank={n}", "--master-addr=127.0.0.1", f"--master-port={port}", *script],
                              cwd=ROOT, env=env, stdout=open(tmp_path / f"node{n}.out", "w"),
                              stderr=open(tmp_path / f"node{n}.err", "w")) for n in (0, 1)]
    try:
        codes = [p.wait(timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = [(tmp_path / f"node{n}.out").read_text() for n in (0, 1)]
    errs = [(tmp_path / f"node{n}.err").read_text() for n in (0, 1)]
    assert codes == [0, 0], "\n".join(o[-3000:] + e[-5000:] for o, e in zip(outs, errs))
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("replica_nodes", [1, 2])
def test_two_nodes_replicas_on_node_1_sync_audit_kill_and_restart(tmp_path, replica_nodes):
    """replica_nodes=1: both replicas on node 1; 2: replica 0 on rank 0's node (a pipe), replica 1 on node 1
    (TCP) — the one SIGKILLed mid-broadcast is on node 1 either way."""
    run = tmp_path / "run"
    out0, _ = _torchrun_nodes(tmp_path, ["tests/workers/cluster_checks.py", str(run),
                                         f"engine.replica_nodes={replica_nodes}"], 1500)
    ranks = json.loads([line for line in out0.splitlines() if line.startswith("{")][-1])["ranks"]
    placed = [line for line in out0.splitlines() if line.startswith("megarl: engine replica")]
    remote = [0, 1] if replica_nodes == 1 else [1]
    # at the start and after the keeper's restart, the remote replicas each time on node 1
    assert [int(line.split()[3].rstrip(":")) for line in placed] == remote * 2, out0
    assert all(" on node 1 (" in line for line in placed)
    for rank, r in enumerate(ranks):
        assert r["senders"] == [0, 1], rank  # PP=2 across the two nodes: each stage sends its own layers
        assert [m["engine/version"] for m in r["steps"]] == [1.0, 2.0], rank
        assert all(m["sync/logprob_gap"] <= 1e-4 for m in r["steps"]), rank  # node 1's replicas got the weights
        assert r["killed"] == {"sync/failures": 1.0, "engine/version": 2.0}, rank  # the old version, not a mix
        assert r["killed_s"] < 60, rank  # no hang: rank 0 saw the link end and dropped the other replica
        assert r["restarts"] == 1 and r["after"]["engine/version"] == 4.0, rank  # node 1 respawned them
        assert r["after"]["sync/logprob_gap"] <= 1e-4 and max(r["gaps"]) <= 1e-4 and r["versions"] == [4, 4], rank
    assert ranks[0]["alive_after_kill"] == [False, False]


@pytest.mark.slow
def test_slurm_two_node_job_trains_with_both_replicas_under_node_1s_step(tmp_path):
    """A real two-node Slurm (tests/cluster/slurm_cluster.sh) through slurm/train.sbatch: one trainer process per
    node, the replicas spawned by node 1's (n2's) trainer, the sync audit after every step."""
    import shutil

    if not all(shutil.which(t) for t in ("slurmctld", "slurmd", "munged", "sbatch")) or os.geteuid() != 0:
        pytest.skip("missing system tool: slurm-wlm and munge (installed by .ci/run), run as root")
    from test_slurm import logs, steps_logged, submit_tiny, wait_for

    cluster = tmp_path / "slurm"
    script = str(ROOT / "tests" / "cluster" / "slurm_cluster.sh")
    up = subprocess.run([script, "start", str(cluster)], capture_output=True, text=True, timeout=120)
    try:
        assert up.returncode == 0, up.stderr
        env = {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf"), "PYTHON": sys.executable,
               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        run_dir = tmp_path / "run"
        job = submit_tiny(env, run_dir, "engine.placement=disaggregated", "engine.replicas=2", "engine.replica_nodes=1",
                          "engine.kv_cache_gib=0.0625", "engine.slots=8", "sync.check_every=1", "train.steps=3")
        state = wait_for(env, job, 1200)
        node0, node1 = logs(run_dir, job, 0)
        batch = (run_dir / "logs" / f"{job}.batch.log").read_text()
        assert state == "COMPLETED", batch + node0[-4000:] + node1[-4000:]
    finally:
        subprocess.run([script, "stop", str(cluster)], timeout=60)
    # torchrun's c10d rendezvous numbers the nodes by (host name, pid), not in Slurm's order: both nodes are this
    # host, so rank 0 (which logs where the replicas run) may be on n1 or n2; its torchrun node 1 is the other
    leader, other = ("n1", "n2") if "megarl: engine replica" in node0 else ("n2", "n1")
    placed = [line for line in (node0 + node1).splitlines() if "megarl: engine replica" in line]
    assert len(placed) == 2 and all(f" on node 1 ({other})" in line for line in placed), (leader, placed)
    assert "step 3/3 |" in node0 + node1 and "eval after RL: pass@1" in node0 + node1
    assert steps_logged(run_dir) == [0, 1, 2, 3]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    gaps = [r["sync/logprob_gap"] for r in rows if "sync/logprob_gap" in r]
    assert len(gaps) >= 3 and max(gaps) <= 1e-4, gaps  # node 1's replicas serve the trainer's weights
