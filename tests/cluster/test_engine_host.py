"""Nodes that run only engine replicas (``engine.replica_nodes_dedicated``, ``megarl/engines/remote/host.py``).

Default run (fast): a real replica host process (``python -m megarl.engines.remote.host``) finds trainer rank 0
through the run directory's rendezvous file (a stale one removed first), links with the run's secret, spawns
the replicas rank 0 names (real ``nodes.serve_remote`` processes that connect back to rank 0), respawns them
over the same link, and kills them and exits 0 when rank 0's link ends; a host that never comes is a start
timeout naming its node; a requeued job's host passes over the first attempt's rendezvous file. Slow: a real
two-node Slurm job (``slurm/train.sbatch``) with one trainer node and one engine-only node hosting two replicas,
one of them killed mid-run and respawned by its host; and that job preempted (SIGUSR1), requeued and continued;
and a three-node job with two engine-only nodes, each hosting one replica at engine TP 2.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from helpers.processes import processes_with_env, wait_until
from helpers.scripts import ROOT

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


@pytest.mark.slow  # (16 s; the default run keeps a linked host serving on through Slurm's preemption SIGTERM)
def test_replica_host_links_spawns_respawns_and_ends_with_rank_0(tmp_path):
    from megarl.engines.remote.host import HostPool, rendezvous_path
    from megarl.engines.remote.nodes import RemoteProcess, Rendezvous

    run = tmp_path / "run"
    path = rendezvous_path(run)
    run.mkdir()
    with socket.socket() as s:  # a stale rendezvous of an earlier job: a port nobody listens on any more
        s.bind(("127.0.0.1", 0))
        path.write_text(json.dumps({"host": "127.0.0.1", "port": s.getsockname()[1], "authkey": "00", "job": ""}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    host = subprocess.Popen([sys.executable, "-m", "megarl.engines.remote.host", "--config", "configs/demo.yaml",
                             "--node", "1", *DEDICATED, f"train.run_dir={run}"], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**env, "PYTHONPATH": str(ROOT), "SLURMD_NODENAME": "n2"})
    spec = dict(model=str(tmp_path / "no-model"), tp=1, max_model_len=64, kv_cache_gib=0.0625, slots=2, seed=0,
                devices="")
    try:
        pool = HostPool(path, 1, 1, "127.0.0.1", 60)
        assert [link[1:] for link in pool.links] == [(1, "n2", host.pid)]
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and json.loads(path.read_text())["port"] == pool.address[1]
        seen = []
        for _ in range(2):  # start, then a restart over the same host link
            rv = Rendezvous("127.0.0.1")
            pids = pool.spawn(rv.address, [[(0, spec), (1, spec)]])
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


def test_a_requeued_host_waits_for_its_own_restart_s_rendezvous(tmp_path, monkeypatch):
    """Job 7 requeued (restart 1): the first attempt's file (tagged 7.0, its listener still taking connections,
    as after a rank 0 killed before it could clean up) is not dialled; the host links once rank 0 of 7.1 publishes."""
    from multiprocessing.connection import Listener

    from megarl.engines.remote.host import connect, publish, rendezvous_path

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    path = rendezvous_path(tmp_path)
    with socket.socket() as old:
        old.bind(("127.0.0.1", 0))
        old.listen(1)
        old.setblocking(False)
        publish(path, ("127.0.0.1", old.getsockname()[1]), b"\0" * 32)  # the first attempt's
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        with pytest.raises(TimeoutError, match=r"engine_hosts.json is job 7.0's, not this job's \(7.1\)"):
            connect(path, 1.0)
        new = Listener(("127.0.0.1", 0), authkey=b"k" * 32)
        publish(path, new.address, b"k" * 32)  # the requeued rank 0's
        accepted = []
        rank0 = threading.Thread(target=lambda: accepted.append(new.accept()), daemon=True)
        rank0.start()
        conn, linked = connect(path, 10.0)
        rank0.join(10)
        assert linked == f"127.0.0.1:{new.address[1]} (job 7.1)" and len(accepted) == 1
        for c in (conn, *accepted, new):
            c.close()
        with pytest.raises(BlockingIOError):
            old.accept()  # nobody dialled the stale rendezvous


def _start_slurm(tmp_path, **env: str):
    """A real Slurm for one test (``tests/cluster/slurm_cluster.sh`` in ``tmp_path/slurm``; ``SLURM_TEST_*`` settings in
    ``env``): (its directory, the script, the start's result), or a skip where its tools are missing."""
    import shutil

    if not all(shutil.which(t) for t in ("slurmctld", "slurmd", "munged", "sbatch")) or os.geteuid() != 0:
        pytest.skip("missing system tool: slurm-wlm and munge (installed by .ci/run), run as root")
    cluster, script = tmp_path / "slurm", str(ROOT / "tests" / "cluster" / "slurm_cluster.sh")
    up = subprocess.run([script, "start", str(cluster)], capture_output=True, text=True, timeout=120,
                        env={**os.environ, **env})
    return cluster, script, up


def _tag_recorder(hosts_file, tags: dict):
    """A poll for ``wait_for``'s ``until``: records each rendezvous file rank 0 publishes (job tag → host:port);
    always False (it only watches)."""
    def tag_seen() -> bool:
        try:
            info = json.loads(hosts_file.read_text())
            tags[info["job"]] = f"{info['host']}:{info['port']}"
        except (OSError, ValueError, KeyError):
            pass
        return False

    return tag_seen


@pytest.mark.slow
def test_slurm_job_with_an_engine_only_node_trains_and_its_host_respawns_a_killed_replica(tmp_path):
    """A real two-node Slurm (tests/cluster/slurm_cluster.sh) through slurm/train.sbatch: torchrun (1 trainer process)
    on n1 only, a replica host on n2 with both replicas, the sync audit after every step; replica 1 is
    SIGKILLed after the first step and the host respawns it at rank 0's word."""
    import re

    from test_slurm import DONE, job_field, steps_logged, submit_tiny, wait_for

    cluster, script, up = _start_slurm(tmp_path)
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


def _processes_naming(text: str) -> list[str]:
    """`ps` lines (not this test's own) whose command line names ``text``: what a job left running."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if text in line and int(line.split()[0]) != os.getpid()]


@pytest.mark.slow
def test_a_preempted_job_with_an_engine_only_node_requeues_and_the_new_host_links_to_the_new_rank_0(tmp_path):
    """Preemption of a job with an engine-only node, on the real two-node Slurm: after step 1 the batch shell gets
    SIGUSR1 the way README says (`scancel --batch --signal=USR1`); the trainers checkpoint and stop, the first
    attempt's host ends with rank 0's link, the script requeues the job, and the requeued job's host links to the
    requeued rank 0 (its rendezvous tagged JOB.1, not the first attempt's), respawns both replicas on n2, and the
    run continues the step count to the end. Two trainer processes on n1 when the machine has 2 cores."""
    import re

    from test_slurm import DONE, job_field, steps_logged, submit_tiny, wait_for

    trainers = 2 if (os.cpu_count() or 1) >= 2 else 1
    cluster, script, up = _start_slurm(tmp_path, SLURM_TEST_CPUS=str(trainers))
    run_dir = tmp_path / "run"
    logs = run_dir / "logs"
    hosts_file = run_dir / "engine_hosts.json"
    spawned = re.compile(r"megarl: replica host on node 1 \(n2\): spawned replicas \{0: (\d+), 1: (\d+)\}")
    steps, tags, stale = 8, {}, socket.socket()
    try:
        assert up.returncode == 0, up.stderr
        env = {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf"), "PYTHON": sys.executable,
               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GPUS_PER_NODE": str(trainers)}
        job = submit_tiny(env, run_dir, *DEDICATED, "engine.kv_cache_gib=0.0625", "engine.slots=8",
                          "sync.check_every=1", f"train.steps={steps}", "train.save_every=100")

        tag_seen = _tag_recorder(hosts_file, tags)

        wait_for(env, job, 900, until=lambda: tag_seen() or steps_logged(run_dir)[-1:] >= [1])
        assert job_field(env, job, "JobState") == "RUNNING", "the job ended before it could be signalled"
        host0 = (logs / f"{job}.0.engines0.log").read_text()
        host0_pid = int(re.search(r"\(n2\), pid (\d+): waiting", host0).group(1))
        first = [int(p) for p in spawned.search(host0).groups()]
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True)
        wait_for(env, job, 300, until=lambda: tag_seen() or job_field(env, job, "Restarts") == "1")
        # the first attempt is over: its host and replicas exited, and its rank 0 removed its rendezvous file
        first_left = [pid for pid in [host0_pid, *first] if not _gone(pid)]
        assert not hosts_file.exists(), hosts_file.read_text()
        # What a first attempt killed before it could clean up (SIGKILL at the time limit) leaves behind: its
        # file, naming a listener that takes connections. The requeued job's host must wait for its own rank 0.
        stale.bind(("127.0.0.1", 0))
        stale.listen(8)
        stale.setblocking(False)
        fd = os.open(hosts_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # (the new rank 0 takes ~20 s)
        with os.fdopen(fd, "w") as f:
            json.dump({"host": "127.0.0.1", "port": stale.getsockname()[1], "authkey": "00" * 32,
                       "job": f"{job}.0"}, f)
        state = wait_for(env, job, 1500, until=lambda: tag_seen() or job_field(env, job, "JobState") in DONE)
        batch = (logs / f"{job}.batch.log").read_text()
        node0 = [(logs / f"{job}.{r}.node0.log").read_text() for r in (0, 1)]
        host0, host1 = [(logs / f"{job}.{r}.engines0.log").read_text() for r in (0, 1)]
        assert state == "COMPLETED", batch + node0[1][-4000:] + host1[-3000:]
        second = [int(p) for p in spawned.search(host1).groups()]
        host1_pid = int(re.search(r"\(n2\), pid (\d+): waiting", host1).group(1))
        # nothing of either attempt left running (checked while Slurm is still up), no rendezvous file left behind
        left = [pid for pid in [host1_pid, *second] if not wait_until(lambda pid=pid: _gone(pid), 20.0)]
        ps_left = _processes_naming(str(run_dir))
        with pytest.raises(BlockingIOError):
            stale.accept()  # nobody dialled the stale rendezvous
    finally:
        stale.close()
        subprocess.run([script, "stop", str(cluster)], timeout=60)
    assert first_left == [] and left == [] and ps_left == [], (first_left, left, ps_left)
    assert not hosts_file.exists()
    assert f"{trainers} processes started by torchrun" in node0[0] + node0[1]
    assert "SIGUSR1" in batch and f"requeueing job {job}" in batch and f"job {job} restart 1:" in batch, batch
    # the first attempt: checkpointed and stopped; its host ended with rank 0's link, its processes are gone
    assert "checkpoint saved, stopping" in node0[0] and f"step {steps}/{steps} |" not in node0[0]
    stopped_at = int(node0[0].split("checkpoint saved, stopping")[0].rsplit("step ", 1)[1].split(":")[0])
    assert "trainer rank 0's link ended" in host0, host0
    assert "still up" not in batch, batch  # the host step ended by itself, before the script requeued the job
    # the requeued job: its host linked to the requeued rank 0 (rendezvous JOB.1), which placed the respawned replicas
    assert tags.keys() == {f"{job}.0", f"{job}.1"} and tags[f"{job}.0"] != tags[f"{job}.1"], tags
    assert f"linked to trainer rank 0 at {tags[f'{job}.1']} (job {job}.1)" in host1, (tags, host1)
    assert host1.count("linked to trainer rank 0") == 1 and not set(second) & set(first)
    placed = [line for line in node0[1].splitlines() if "megarl: engine replica" in line]
    assert [int(re.search(r"engine replica \d+: pid (\d+) on node 1 \(n2\)", line).group(1)) for line in placed] \
        == second, node0[1][-3000:]
    assert f"at step {stopped_at}" in node0[1] and "resumed from" in node0[1]
    assert f"step {steps}/{steps} |" in node0[1] and "eval after RL: pass@1" in node0[1]
    assert "trainer rank 0's link ended" in host1, host1
    assert steps_logged(run_dir) == list(range(steps + 1))  # one line per step, as if never stopped
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    gaps = [r["sync/logprob_gap"] for r in rows if "sync/logprob_gap" in r]
    assert len(gaps) >= steps - 1 and max(gaps) <= 1e-4, rows


def _children(pid: int) -> dict[int, str]:
    """Process ``pid``'s children: pid → command line ({} once it is gone)."""
    out = {}
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in f.read().split():
                    with open(f"/proc/{child}/cmdline", "rb") as g:
                        out[int(child)] = g.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        pass
    return out


def _processes_of_job(job: str) -> list[str]:
    """`ps`-like lines of every process whose environment says it belongs to Slurm job ``job`` (whatever it
    was spawned by: hosts, replicas, vLLM's TP workers)."""
    return [line for line in processes_with_env(f"SLURM_JOB_ID={job}") if not _gone(int(line.split()[0]))]


@pytest.mark.slow
def test_a_three_node_job_with_two_engine_only_nodes_runs_one_tp2_replica_on_each(tmp_path):
    """Three nodes of the real test Slurm (``SLURM_TEST_NODES=3``: n3 at 127.0.0.3): torchrun (1 trainer process)
    on n1 only, a replica host on each of n2 and n3 (``engine.replica_nodes=2``), ``engine.replicas=2`` at
    ``engine.tensor_parallel_size=2``: host i spawns replica i (its share i·R/N … of host.py's rule), a TP-2
    replica whose two vLLM workers both join the weight transfer; the audit after every sync; both hosts end
    with the run and nothing of the job is left running."""
    import re

    from test_slurm import job_field, steps_logged, submit_tiny, wait_for

    cluster, script, up = _start_slurm(tmp_path, SLURM_TEST_NODES="3")
    run_dir = tmp_path / "run"
    logs = run_dir / "logs"
    steps = 4
    try:
        assert up.returncode == 0, up.stderr
        env = {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf"), "PYTHON": sys.executable,
               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        job = submit_tiny(env, run_dir, "engine.placement=disaggregated", "engine.replicas=2", "engine.replica_nodes=2",
                          "engine.replica_nodes_dedicated=true", "engine.tensor_parallel_size=2",
                          "engine.kv_cache_gib=0.0625", "engine.slots=8", "sync.check_every=1", f"train.steps={steps}",
                          nodes=3)
        workers: dict[int, set] = {}  # replica pid → (child pid, command line) seen mid-run: vLLM's TP workers

        def watch() -> bool:
            for i in (0, 1):
                log = logs / f"{job}.0.engines{i}.log"
                for pid in re.findall(r"spawned replicas \{\d+: (\d+)\}", log.read_text() if log.exists() else ""):
                    workers.setdefault(int(pid), set()).update(_children(int(pid)).items())
            return False

        state = wait_for(env, job, 1500, until=watch)
        batch = (logs / f"{job}.batch.log").read_text()
        node0 = (logs / f"{job}.0.node0.log").read_text()
        hosts = [(logs / f"{job}.0.engines{i}.log").read_text() for i in (0, 1)]
        assert state == "COMPLETED", batch + node0[-4000:] + hosts[0][-2000:] + hosts[1][-2000:]
        assert job_field(env, job, "NodeList") == "n[1-3]"
        # nothing of the job left running (checked while Slurm is still up): hosts, replicas, their TP workers
        host_pids = [int(re.search(r", pid (\d+): waiting", text).group(1)) for text in hosts]
        spawned = [re.findall(r"spawned replicas \{([^}]*)\}", text) for text in hosts]
        replica_pids = [int(p) for found in spawned for entry in found for p in re.findall(r"\d+: (\d+)", entry)]
        worker_pids = sorted({pid for children in workers.values() for pid, _ in children})
        left = [pid for pid in host_pids + replica_pids + worker_pids
                if not wait_until(lambda pid=pid: _gone(pid), 20.0)]
        job_left = [] if wait_until(lambda: not _processes_of_job(job), 20.0) else _processes_of_job(job)
        ps_left = _processes_naming(str(run_dir))
    finally:
        subprocess.run([script, "stop", str(cluster)], timeout=60)
    assert left == [] and job_left == [] and ps_left == [], (left, job_left, ps_left)
    assert "1 trainer nodes × 1 + 2 engine-only nodes" in batch, batch
    assert not (logs / f"{job}.0.node1.log").exists() and not (logs / f"{job}.0.node2.log").exists()  # no trainer
    assert len(list((logs / f"{job}.0").rglob("stdout.log"))) == 1  # torchrun started one trainer process, on n1
    # host i (node 1 + i, n2 / n3) spawned exactly replica i, once (R/N = 1 each), and ended with rank 0's link
    for i, text in enumerate(hosts):
        assert f"megarl: replica host on node {1 + i} (n{2 + i}), pid {host_pids[i]}: waiting" in text, text
        assert len(spawned[i]) == 1, text
        assert re.fullmatch(rf"{i}: \d+", spawned[i][0]), text
        assert "trainer rank 0's link ended" in text and "[default" not in text, text
    # each replica ran at TP 2: two vLLM worker processes (their titles), both in the weight transfer group
    # (1 + R·TP ranks: a sync, and its audit, complete only if every worker of every replica joined)
    for pid in replica_pids:
        assert {"VLLM::Worker_TP0", "VLLM::Worker_TP1"} <= {title for _, title in workers.get(pid, ())}, workers
    placed = re.findall(r"megarl: engine replica (\d): pid (\d+) on node (\d) \((n\d)\)", node0)  # (no restart)
    assert placed == [("0", str(replica_pids[0]), "1", "n2"), ("1", str(replica_pids[1]), "2", "n3")], node0[-3000:]
    assert f"step {steps}/{steps} |" in node0 and "eval after RL: pass@1" in node0, node0[-3000:]
    assert steps_logged(run_dir) == list(range(steps + 1))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    gaps = [r["sync/logprob_gap"] for r in rows if "sync/logprob_gap" in r]
    # both TP-2 replicas serve the trainer's weights after every sync
    assert len(gaps) >= steps and max(gaps) <= 1e-4, rows


def test_a_linked_host_and_its_replicas_serve_on_through_slurms_preemption_sigterm(tmp_path):
    """Slurm's preemption SIGTERM reaches every process of the job, the replica host and its replicas too: linked,
    the host logs it and serves on (trainer rank 0 checkpoints first, then ends the link, which ends the host with 0);
    the replicas inherited the signal blocked. An unlinked host still exits 143 on SIGTERM (the script's kill)."""
    from megarl.engines.remote.host import HostPool, rendezvous_path
    from megarl.engines.remote.nodes import Rendezvous

    run = tmp_path / "run"
    run.mkdir()
    path = rendezvous_path(run)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    cmd = [sys.executable, "-m", "megarl.engines.remote.host", "--config", "configs/demo.yaml", "--node", "1",
           *DEDICATED, f"train.run_dir={run}"]
    env = {**env, "PYTHONPATH": str(ROOT), "SLURMD_NODENAME": "n2"}
    host = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, env=env)
    spec = dict(model=str(tmp_path / "no-model"), tp=1, max_model_len=64, kv_cache_gib=0.0625, slots=2, seed=0,
                devices="")
    try:
        pool = HostPool(path, 1, 1, "127.0.0.1", 60)
        rv = Rendezvous("127.0.0.1")
        pids = pool.spawn(rv.address, [[(0, spec)]])
        links = rv.accept([0], 60)
        for pid in [host.pid, *pids.values()]:
            os.kill(pid, signal.SIGTERM)
        time.sleep(1.0)
        assert host.poll() is None and not any(_gone(pid) for pid in pids.values())
        assert all(proc.is_alive() for _, proc in links.values())
        pool.close()  # rank 0 saved its checkpoint and ends: the host ends its replicas and exits 0
        assert host.wait(30) == 0
        assert wait_until(lambda: all(_gone(pid) for pid in pids.values()), 20.0)
    finally:
        if host.poll() is None:
            host.kill()
            host.wait(30)
    assert "SIGTERM while linked to trainer rank 0" in host.stdout.read()
    out = tmp_path / "waiting.log"
    with open(out, "w") as f:
        waiting = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert wait_until(lambda: "waiting for trainer rank 0" in out.read_text(), 60.0), out.read_text()
        waiting.send_signal(signal.SIGTERM)
        assert waiting.wait(30) == 143
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait(30)


@pytest.mark.slow
def test_slurm_preemption_killing_a_job_with_an_engine_only_node_mid_save_leaves_nothing_that_traps_the_requeue(
        tmp_path):
    """Slurm's own preemption (PreemptMode=REQUEUE, GraceTime 1 s) of a job with an engine-only node, its
    checkpoint slowed past the grace (MEGARL_TEST_SLOW_STOP): the SIGTERM reaches the host and its replicas too,
    and the linked host serves on; then Slurm SIGKILLs everything mid-save and requeues the job itself. The
    SIGKILLed rank 0 leaves its rendezvous file (tagged JOB.0) behind: the requeued host must link to the requeued
    rank 0 (JOB.1), nothing of the first attempt may be left, and the run resumes from the last periodic checkpoint."""
    import re

    from test_slurm import job_field, last_step, preempt, steps_logged, submit_tiny, wait_for

    cluster, script, up = _start_slurm(tmp_path, SLURM_TEST_PREEMPT="1")
    run_dir = tmp_path / "run"
    logs = run_dir / "logs"
    hosts_file = run_dir / "engine_hosts.json"
    spawned = re.compile(r"megarl: replica host on node 1 \(n2\): spawned replicas \{0: (\d+), 1: (\d+)\}")
    steps, tags = 12, {}

    tag_seen = _tag_recorder(hosts_file, tags)

    try:
        assert up.returncode == 0, up.stderr
        env = {**os.environ, "SLURM_CONF": str(cluster / "slurm.conf"), "PYTHON": sys.executable,
               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MEGARL_TEST_SLOW_STOP": "90"}
        job = submit_tiny(env, run_dir, *DEDICATED, "engine.kv_cache_gib=0.0625", "engine.slots=8",
                          f"train.steps={steps}", "train.save_every=3")
        wait_for(env, job, 900, until=lambda: tag_seen() or len(steps_logged(run_dir)) >= 5)  # saved at step 3
        host0 = (logs / f"{job}.0.engines0.log").read_text()
        host0_pid = int(re.search(r"\(n2\), pid (\d+): waiting", host0).group(1))
        first = [int(p) for p in spawned.search(host0).groups()]
        preempt(env, tmp_path, job)
        wait_for(env, job, 300, until=lambda: tag_seen() or job_field(env, job, "Restarts") == "1")
        first_left = [pid for pid in [host0_pid, *first] if not wait_until(lambda pid=pid: _gone(pid), 20.0)]
        state = wait_for(env, job, 1500, until=lambda: tag_seen() or job_field(env, job, "JobState") in
                         ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"))
        batch = (logs / f"{job}.batch.log").read_text()
        node0 = [(logs / f"{job}.{r}.node0.log").read_text() for r in (0, 1)]
        host0, host1 = [(logs / f"{job}.{r}.engines0.log").read_text() for r in (0, 1)]
        assert state == "COMPLETED" and job_field(env, job, "Restarts") == "1", batch + node0[1][-4000:] + host1[-3000:]
        second = [int(p) for p in spawned.search(host1).groups()]
        host1_pid = int(re.search(r"\(n2\), pid (\d+): waiting", host1).group(1))
        left = [pid for pid in [host1_pid, *second] if not wait_until(lambda pid=pid: _gone(pid), 20.0)]
        ps_left = _processes_naming(str(run_dir))
    finally:
        subprocess.run([script, "stop", str(cluster)], timeout=60)
    assert first_left == [] and left == [] and ps_left == [], (first_left, left, ps_left)
    # the first attempt: the notice reached the linked host, which served on; the save was cut by the SIGKILL
    assert "SIGTERM while linked to trainer rank 0" in host0 and "link ended" not in host0, host0
    assert "slowed by 90 s" in node0[0] and "checkpoint saved, stopping" not in node0[0]
    assert "requeueing" not in batch and f"job {job} restart 1:" in batch, batch  # Slurm requeued it
    # the requeued host passed over the killed rank 0's rendezvous (JOB.0) and linked to the requeued one's
    assert tags.keys() == {f"{job}.0", f"{job}.1"}, tags
    assert f"linked to trainer rank 0 at {tags[f'{job}.1']} (job {job}.1)" in host1, (tags, host1)
    assert host1.count("linked to trainer rank 0") == 1 and not set(second) & set(first)
    ran_to = last_step(node0[0])
    resumed = (ran_to - 1) // 3 * 3  # the last periodic checkpoint before the one being written
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{resumed:06d}'} at step {resumed}" in node0[1], node0[1]
    assert f"step {steps}/{steps} |" in node0[1] and "trainer rank 0's link ended" in host1
    assert steps_logged(run_dir) == list(range(steps + 1))
