"""Nodes that run only engine replicas (``engine.replica_nodes_dedicated``, ``megarl/engines/host.py``).

Default run (fast): a real replica host process (``python -m megarl.engines.host``) finds trainer rank 0
through the run directory's rendezvous file (a stale one removed first), links with the run's secret, spawns
the replicas rank 0 names (real ``nodes.serve_remote`` processes that connect back to rank 0), respawns them
over the same link, and kills them and exits 0 when rank 0's link ends; a host that never comes is a start
timeout naming its node. Slow: a real two-node Slurm job (``slurm/train.sbatch``) with one trainer node and
one engine-only node hosting two replicas, one of them killed mid-run and respawned by its host.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
from check_helpers import wait_until

from conftest import ROOT

DEDICATED = ["engine.placement=disaggregated", "engine.replicas=2", "engine.replica_nodes=1",
             "engine.replica_nodes_dedicated=true"]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().split(")")[-1].split()[0] == "Z"


def test_config_key_names_itself_and_valid_values():
    from megarl.config import load_config, validate
    from megarl.config.loader import ConfigError

    with pytest.raises(ConfigError, match=r"engine.replica_nodes_dedicated=true .* but engine.replica_nodes=0; "
                                          r"valid: engine.replica_nodes >= 1 with it, or "
                                          r"engine.replica_nodes_dedicated=false"):
        validate(load_config("configs/demo.yaml", ["engine.placement=disaggregated",
                                                    "engine.replica_nodes_dedicated=true"]), 1)
    cfg = load_config("configs/demo.yaml", DEDICATED)
    validate(cfg, 1)
    from megarl.launch.plan import trainer_nodes  # megarl plan sizes the trainer on the other nodes

    assert trainer_nodes(cfg, 3) == 2 and trainer_nodes(load_config("configs/demo.yaml", DEDICATED[:3]), 3) == 3
    with pytest.raises(ConfigError, match=r"--nodes 1 leaves no trainer node .* valid: --nodes >= 2"):
        trainer_nodes(cfg, 1)


def test_launch_engine_nodes_query(capsys):
    from megarl.launch.__main__ import main

    assert main(["engine-nodes", "--config", "configs/demo.yaml", *DEDICATED]) == 0
    assert main(["engine-nodes", "--config", "configs/demo.yaml", *DEDICATED[:3]]) == 0  # not dedicated: none
    assert capsys.readouterr().out.split() == ["1", "0"]
    assert main(["engine-nodes", "--config", "configs/demo.yaml", "engine.replica_nodes_dedicated=true"]) == 2
    assert "engine.replica_nodes_dedicated=true" in capsys.readouterr().err


def test_replica_host_links_spawns_respawns_and_ends_with_rank_0(tmp_path):
    from megarl.engines.host import HostPool, rendezvous_path
    from megarl.engines.nodes import RemoteProcess, Rendezvous

    run = tmp_path / "run"
    path = rendezvous_path(run)
    run.mkdir()
    with socket.socket() as s:  # a stale rendezvous of an earlier job: a port nobody listens on any more
        s.bind(("127.0.0.1", 0))
        path.write_text(json.dumps({"host": "127.0.0.1", "port": s.getsockname()[1], "authkey": "00", "job": ""}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    host = subprocess.Popen([sys.executable, "-m", "megarl.engines.host", "--config", "configs/demo.yaml", "--node", "1",
                             *DEDICATED, f"train.run_dir={run}"], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**env, "PYTHONPATH": str(ROOT), "SLURMD_NODENAME": "n2"})
    spec = dict(model=str(tmp_path / "no-model"), tp=1, max_model_len=64, kv_cache_gib=0.0625, slots=2, seed=0,
                devices="")
    try:
        pool = HostPool(path, 1, 1, "127.0.0.1", 60)
        assert [link[1:] for link in pool.links] == [(1, "n2", host.pid)]
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and json.loads(path.read_text())["port"] == pool.address[1]
        seen = []
        for _ in range(2):  # start, then a restart over the same host link
            rv = Rendezvous("127.0.0.1")
            pids = pool.spawn(rv.address, {0: spec, 1: spec})
            links = rv.accept([0, 1], 60)
            for k, (_, proc) in links.items():
                assert isinstance(proc, RemoteProcess) and (proc.pid, proc.node, proc.host) == (pids[k], 1, "n2")
            assert not set(pids.values()) & set(seen)
            seen += pids.values()
            if len(seen) == 2:  # a restart: rank 0 drops the replicas' links (they end themselves), then respawns
                for _, proc in links.values():
                    proc.kill()
        assert all(_gone(pid) for pid in seen[:2])  # the host reaped the first ones before spawning the second
        assert all(proc.is_alive() for _, proc in links.values())
        pool.close()  # rank 0 ends: the host kills its replicas and exits 0
        assert host.wait(30) == 0
        assert wait_until(lambda: all(_gone(pid) for pid in seen[2:]), 20.0)
        assert wait_until(lambda: not any(proc.is_alive() for _, proc in links.values()), 20.0)
        assert not path.exists()
    finally:
        if host.poll() is None:
            host.send_signal(signal.SIGTERM)
            host.wait(30)
    out = host.stdout.read()
    assert out.count("megarl: replica host on node 1 (n2): spawned replicas") == 2, out
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"engine replica host\(s\) of node\(s\) 1 \(engine.replica_nodes_dedicated: "
                                           r"the allocation's last 1 node\(s\)\) did not connect to trainer rank 0 at "
                                           r"127.0.0.1:\d+ \(published in .*engine_hosts.json\) within 1s"):
        HostPool(path, 1, 1, "127.0.0.1", 1)
    assert time.monotonic() - start < 15 and not path.exists()


@pytest.mark.slow
def test_slurm_job_with_an_engine_only_node_trains_and_its_host_respawns_a_killed_replica(tmp_path):
    """A real two-node Slurm (tests/slurm_cluster.sh) through slurm/train.sbatch: torchrun (1 trainer process)
    on n1 only, a replica host on n2 with both replicas, the sync audit after every step; replica 1 is
    SIGKILLed after the first step and the host respawns it at rank 0's word."""
    import re
    import shutil

    if not all(shutil.which(t) for t in ("slurmctld", "slurmd", "munged", "sbatch")) or os.geteuid() != 0:
        pytest.skip("missing system tool: slurm-wlm and munge (installed by .ci/run), run as root")
    from test_slurm import DONE, job_field, steps_logged, submit_tiny, wait_for

    cluster = tmp_path / "slurm"
    script = str(ROOT / "tests" / "slurm_cluster.sh")
    up = subprocess.run([script, "start", str(cluster)], capture_output=True, text=True, timeout=120)
    run_dir = tmp_path / "run"
    logs = run_dir / "logs"
    spawned = re.compile(r"megarl: replica host on node 1 \(n2\): spawned replicas \{0: (\d+), 1: (\d+)\}")
    try:
        assert up.returncode == 0, up.stderr
        env = {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf"), "PYTHON": sys.executable,
               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        job = submit_tiny(env, run_dir, *DEDICATED, "engine.kv_cache_gib=0.0625", "engine.slots=8",
                          "sync.check_every=1", "train.steps=8")
        host_log = logs / f"{job}.0.engines0.log"
        first: list[str] = []
        for i in range(15000):  # replica 1 dies mid-run, once: right after step 1 (a step takes ~1 s here)
            if steps_logged(run_dir)[-1:] >= [1] and (match := spawned.search(host_log.read_text())):
                first.extend(match.groups())
                os.kill(int(first[1]), signal.SIGKILL)
                break
            if i % 50 == 0 and job_field(env, job, "JobState") in DONE:
                break
            time.sleep(0.1)
        state = wait_for(env, job, 1500)
        batch = (logs / f"{job}.batch.log").read_text()
        node0 = (logs / f"{job}.0.node0.log").read_text()
        host_out = host_log.read_text()
        assert state == "COMPLETED", batch + node0[-4000:] + host_out[-3000:]
    finally:
        subprocess.run([script, "stop", str(cluster)], timeout=60)
    assert "1 trainer nodes × 1 + 1 engine-only nodes" in batch
    assert not (logs / f"{job}.0.node1.log").exists()  # no trainer step on n2: torchrun ran on n1 alone
    assert "megarl: replica host on node 1 (n2)" in host_out and "[default" not in host_out, host_out
    placed = [line for line in node0.splitlines() if "megarl: engine replica" in line]
    assert len(placed) == 4 and all(" on node 1 (n2)" in line for line in placed), node0[-3000:]  # start + restart
    assert first, "replica 1 was never killed"
    respawns = spawned.findall(host_out)
    assert len(respawns) == 2 and not set(respawns[1]) & set(first), host_out  # new processes, by the same host
    assert re.search(r"the previous ones had exited with \{[^}]*1: -9", host_out), host_out  # it saw the SIGKILL
    assert "trainer rank 0's link ended" in host_out  # and it ended with the run
    assert "restart 1/" in node0, node0[-3000:]  # the keeper's containment restarted them
    assert "step 8/8 |" in node0 and "eval after RL: pass@1" in node0
    assert steps_logged(run_dir) == list(range(9))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = {r["step"]: r for r in rows if "engine/version" in r}
    gaps = [r["sync/logprob_gap"] for r in steps.values() if "sync/logprob_gap" in r]
    # the engine node's replicas serve the trainer's weights (a sync the kill broke has no audit: counted instead)
    assert len(gaps) >= 6 and max(gaps) <= 1e-4 and "sync/logprob_gap" in steps[8], rows
    assert steps[8]["engine/version"] == 8.0 and steps[8]["faults/engine_restarts"] >= 1, rows  # respawned, synced
