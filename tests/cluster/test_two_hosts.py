"""Two real hosts on one machine: Linux network namespaces A and B joined by a veth pair.

Every other multi-node test runs its "nodes" on one network stack, where a wrong address (loopback, Debian's
127.0.1.1, the container's own eth0) still reaches the other side. Here A (10.233.0.1) and B (10.233.0.2)
each have their own loopback, routes, host name (a UTS namespace) and /etc/hosts (``ip netns exec`` binds
/etc/netns/NAME/hosts), so the only way between them is the veth: an address that is wrong across real hosts
is wrong here too. Variants of the host name's entry: its own address ("own"), Debian's 127.0.1.1 ("debian"),
none at all ("unresolvable"), and each host's name and default route on a second network of its own that the
other cannot reach ("multihomed", where the trainer's host sets ``MEGARL_NODE_ADDR`` as the README says).

Default run (fast): ``nodes.node_address()`` and ``nodes.local_address_to`` inside A give A's veth address in
every single-network variant, a listener on A's loopback is not reachable from B, and a host started outside
Slurm is told which ``--node`` to pass. Slow: a gloo weight-transfer group (``gloo_transfer.join_group``)
between A and B ("debian", "multihomed"); and a training run, torchrun in A and a replica host
(``python -m megarl.engines.remote.host --node 1``) in B with ``engine.replica_nodes_dedicated`` ("own", "debian": no
``MEGARL_NODE_ADDR``; "multihomed"): it completes, both replicas run in B's namespace, the weights cross the
veth, the audit after every sync is <= 1e-4, and nothing is left running.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers.processes import wait_until
from helpers.scripts import ROOT

ADDR = {"a": "10.233.0.1", "b": "10.233.0.2"}
HOSTS_LINE = {"own": "{addr} {name}\n", "debian": "127.0.1.1 {name}\n", "unresolvable": ""}
# "multihomed": each host's second network (its default route, its host name's address), which the other cannot reach
OTHER_NET = {"a": "10.234.0.1", "b": "10.235.0.2"}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


class TwoHosts:
    """Namespaces ``<tag>a`` and ``<tag>b``, a veth pair between them, a host name and /etc/hosts each."""

    def __init__(self, tag: str, variant: str) -> None:
        self.ns = {side: f"{tag}{side}" for side in "ab"}
        self.name = {side: f"{tag}-host{side}" for side in "ab"}
        self.veth = {side: f"{tag}v{side}" for side in "ab"}
        self.other = {side: (f"{tag}m{side}", f"{tag}n{side}") for side in "ab"}  # "multihomed": a 2nd veth in each
        self.variant = variant

    def up(self) -> None:
        ns, veth = self.ns, self.veth
        self.down()  # what a killed earlier run of this pid left under these names
        for side in "ab":
            _ip("netns", "add", ns[side])
        _ip("link", "add", veth["a"], "type", "veth", "peer", "name", veth["b"])
        for side, other in (("a", "b"), ("b", "a")):
            _ip("link", "set", veth[side], "netns", ns[side])
            _ip("-n", ns[side], "addr", "add", f"{ADDR[side]}/24", "dev", veth[side])
            _ip("-n", ns[side], "link", "set", veth[side], "up")
            _ip("-n", ns[side], "link", "set", "lo", "up")
            if self.variant != "multihomed":
                _ip("-n", ns[side], "route", "add", "default", "via", ADDR[other])
        for side in "ab" if self.variant == "multihomed" else "":  # default route and host name on the other net
            _ip("link", "add", self.other[side][0], "type", "veth", "peer", "name", self.other[side][1])
            for end in self.other[side]:
                _ip("link", "set", end, "netns", ns[side])
                _ip("-n", ns[side], "link", "set", end, "up")
            _ip("-n", ns[side], "addr", "add", f"{OTHER_NET[side]}/24", "dev", self.other[side][0])
            _ip("-n", ns[side], "route", "add", "default", "via", OTHER_NET[side].rsplit(".", 1)[0] + ".254")
        self.hosts(self.variant)
        for side in "ab":  # entering them works here (mounts in a new mount namespace, a UTS namespace)
            subprocess.run(self.cmd(side, ["true"]), capture_output=True, text=True, timeout=30, check=True)

    def hosts(self, variant: str) -> None:
        """Write each namespace's /etc/hosts for ``variant`` (read at every ``ip netns exec``)."""
        self.variant = variant
        for side in "ab":
            d = f"/etc/netns/{self.ns[side]}"
            os.makedirs(d, exist_ok=True)
            with open(f"{d}/hosts", "w") as f:
                own = OTHER_NET[side] if variant == "multihomed" else ADDR[side]
                f.write("127.0.0.1 localhost\n" + HOSTS_LINE.get(variant, HOSTS_LINE["own"]).format(
                    addr=own, name=self.name[side]))
            with open(f"{d}/resolv.conf", "w") as f:  # no DNS server to wait for: a name not in hosts fails at once
                f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def cmd(self, side: str, argv: list[str]) -> list[str]:
        """``argv`` run on host ``side``: in its network namespace, under its own host name."""
        return ["ip", "netns", "exec", self.ns[side], "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', self.name[side], *argv]

    def pids(self, side: str) -> list[int]:
        return [int(p) for p in _ip("netns", "pids", self.ns[side], check=False).stdout.split()]

    def net_inode(self, side: str) -> int:
        return os.stat(f"/run/netns/{self.ns[side]}").st_ino

    def tx_bytes(self, side: str) -> int:
        link = json.loads(_ip("-n", self.ns[side], "-s", "-j", "link", "show", self.veth[side]).stdout)[0]
        return int(link["stats64"]["tx"]["bytes"])

    def down(self) -> None:
        """Kill what is left in the namespaces, delete the veth and both namespaces and their /etc/netns files."""
        for side in "ab":
            for pid in self.pids(side):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for side in "ab":
            wait_until(lambda side=side: not self.pids(side), 10.0)
            for link in (self.veth[side], *self.other[side]):
                _ip("-n", self.ns[side], "link", "del", link, check=False)
            _ip("netns", "del", self.ns[side], check=False)
            _ip("link", "del", self.veth[side], check=False)  # (gVisor keeps a moved veth's peer alive)
            shutil.rmtree(f"/etc/netns/{self.ns[side]}", ignore_errors=True)
        for end in (*self.other["a"], *self.other["b"]):
            _ip("link", "del", end, check=False)
        try:
            os.rmdir("/etc/netns")  # only when no other namespace has files there
        except OSError:
            pass


def _skip_reason() -> str:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux (network namespaces)"
    missing = [t for t in ("ip", "unshare") if not shutil.which(t)]
    if missing:
        return f"missing system tool: {', '.join(missing)} (iproute2, util-linux)"
    return ""


@pytest.fixture
def two_hosts(request):
    """Hosts A and B (``request.param``: the /etc/hosts variant, default "own"); always torn down."""
    if why := _skip_reason():
        pytest.skip(why)
    hosts = TwoHosts(f"mr{os.getpid() % 100000}", getattr(request, "param", "own"))
    try:
        hosts.up()
    except subprocess.CalledProcessError as exc:
        hosts.down()
        pytest.skip(f"network namespaces or veth pairs are not available here: {' '.join(exc.cmd)}: "
                    f"{exc.stderr.strip()}")
    except BaseException:
        hosts.down()
        raise
    try:
        yield hosts
    finally:
        hosts.down()
        left = [n for n in hosts.ns.values() if n in _ip("netns", "list", check=False).stdout.split()]
        assert not left and not any(os.path.exists(f"/etc/netns/{n}") for n in hosts.ns.values()), left


def _env() -> dict:
    """This test's environment, without what would pick an address for the code under test."""
    drop = ("MEGARL_NODE_ADDR", "GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM", "TORCHELASTIC"))}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


ADDRESSES = """
import socket, sys
from megarl.engines.remote.nodes import local_address_to, node_address
try:
    named = socket.gethostbyname(socket.gethostname())
except OSError:
    named = "none"
print(socket.gethostname(), named, node_address(), local_address_to(sys.argv[1]))
"""

LOOPBACK_ONLY = """
import socket, sys
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
sys.stdin.read()
"""

DIAL = """
import socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5).close()
    print("reached")
except OSError as exc:
    print("refused", exc)
"""


def test_the_published_address_is_the_veth_s_in_every_host_name_variant(two_hosts):
    """Inside A, no MEGARL_NODE_ADDR: the address rank 0 publishes (``node_address``) and the one a process
    binds to reach B (``local_address_to``) are A's veth address, whether A's host name resolves to it, to
    Debian's 127.0.1.1 or to nothing; and B cannot reach a listener on A's loopback (the fixture's isolation)."""
    seen = {}
    for variant in HOSTS_LINE:
        two_hosts.hosts(variant)
        out = subprocess.run(two_hosts.cmd("a", [sys.executable, "-c", ADDRESSES, ADDR["b"]]), capture_output=True,
                             text=True, timeout=60, cwd=ROOT, env=_env())
        assert out.returncode == 0, out.stderr
        seen[variant] = out.stdout.split()
    name = two_hosts.name["a"]
    assert seen == {"own": [name, ADDR["a"], ADDR["a"], ADDR["a"]],
                    "debian": [name, "127.0.1.1", ADDR["a"], ADDR["a"]],
                    "unresolvable": [name, "none", ADDR["a"], ADDR["a"]]}, seen
    server = subprocess.Popen(two_hosts.cmd("a", [sys.executable, "-c", LOOPBACK_ONLY]), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=_env())
    try:
        port = server.stdout.readline().strip()
        dial = subprocess.run(two_hosts.cmd("b", [sys.executable, "-c", DIAL, port]), capture_output=True, text=True,
                              timeout=60, env=_env())
        assert dial.stdout.startswith("refused"), (port, dial.stdout, dial.stderr)
    finally:
        server.stdin.close()
        server.wait(30)


GROUP_SENDER = """
import sys, torch
from megarl.weight_sync.transport import join_group, listen
from megarl.engines.remote.nodes import node_address
sock = listen(node_address())
host, port = sock.getsockname()
print(host, port, flush=True)
group = join_group(host, port, 0, 2, "gloo", 60, listen_socket=sock)
group.broadcast(torch.arange(1000, dtype=torch.float32), 0).wait()
print("sent", flush=True)
"""

GROUP_RECEIVER = """
import sys, torch
from megarl.weight_sync.transport import join_group
group = join_group(sys.argv[1], int(sys.argv[2]), 1, 2, "gloo", 60)
got = torch.zeros(1000)
group.broadcast(got, 0).wait()
print("received", float(got.sum()), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("two_hosts, node_addr", [("debian", ""), ("multihomed", ADDR["a"])], indirect=["two_hosts"])
def test_a_weight_transfer_group_joins_across_the_veth(two_hosts, node_addr):
    """A trainer sender in A and an engine worker in B. "debian": both host names at 127.0.1.1; "multihomed": each
    host's name and default route on a second network of its own that the other has no route to, and
    ``MEGARL_NODE_ADDR`` (as the README says) on the trainer's host A only. The group's store is at A's veth address and
    gloo's own links bind the veth addresses too (torch's default binds the host name's address — 127.0.1.1, or the
    other network — and sends it to the peer, which then cannot reach it)."""
    if node_addr:  # without it A publishes its host name's address, on the network B has no route to
        out = subprocess.run(two_hosts.cmd("a", [sys.executable, "-c", ADDRESSES, ADDR["b"]]), capture_output=True,
                             text=True, timeout=60, cwd=ROOT, env=_env())
        assert out.stdout.split()[1:] == [OTHER_NET["a"], OTHER_NET["a"], ADDR["a"]], out.stdout + out.stderr
    env = {**_env(), **({"MEGARL_NODE_ADDR": node_addr} if node_addr else {})}
    sender = subprocess.Popen(two_hosts.cmd("a", [sys.executable, "-c", GROUP_SENDER]), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env, start_new_session=True)
    try:
        host, port = sender.stdout.readline().split()
        assert host == ADDR["a"]
        out = subprocess.run(two_hosts.cmd("b", [sys.executable, "-c", GROUP_RECEIVER, host, port]),
                             capture_output=True, text=True, timeout=240, cwd=ROOT, env=_env())
        assert out.stdout.split() == ["received", str(float(sum(range(1000))))], out.stdout + out.stderr[-3000:]
        assert sender.wait(60) == 0 and sender.stdout.read().split() == ["sent"], sender.stderr.read()[-3000:]
    finally:
        if sender.poll() is None:
            os.killpg(sender.pid, signal.SIGKILL)
            sender.wait()


def _metrics(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("two_hosts, node_addr", [("own", ""), ("debian", ""), ("multihomed", ADDR["a"])],
                         indirect=["two_hosts"])
def test_a_trainer_on_host_a_trains_with_both_replicas_on_engine_only_host_b(two_hosts, node_addr, tmp_path):
    """torchrun (1 trainer process; 2 where the machine has the cores) in A, a replica host in B
    (``--node 1``: the first node after the trainer's one), ``engine.replica_nodes_dedicated``, no
    MEGARL_NODE_ADDR (but on A where it is multi-homed): the host finds rank 0 at A's veth address through
    the run directory, both replicas
    run in B's network namespace, every byte the syncs report went over the veth, the audit after every
    sync is <= 1e-4, and when the run ends nothing is left running in either namespace."""
    import re

    run_dir, steps = tmp_path / "run", 3
    trainers = 2 if (os.cpu_count() or 1) >= 2 else 1
    overrides = ["model.path=" + str(run_dir / "model"), f"train.run_dir={run_dir}", "parallel.tp=1", "parallel.pp=1",
                 "engine.placement=disaggregated", "engine.replicas=2", "engine.replica_nodes=1",
                 "engine.replica_nodes_dedicated=true", "engine.kv_cache_gib=0.0625", "engine.slots=8",
                 "sync.check_every=1", f"train.steps={steps}", "sync.timeout_s=120"]
    config = ["--config", "configs/tiny_cpu.yaml"]
    trainer_log, host_log = tmp_path / "trainer.log", tmp_path / "host.log"
    host = subprocess.Popen(two_hosts.cmd("b", [sys.executable, "-m", "megarl.engines.remote.host", *config,
                                                "--node", "1", "--wait-s", "900", *overrides]),
                            cwd=ROOT, env=_env(), stdout=open(host_log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    trainer = subprocess.Popen(two_hosts.cmd("a", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   "--nnodes=1", f"--nproc-per-node={trainers}", "-m", "megarl.cli",
                                                   "train", *config, *overrides]),
                               cwd=ROOT, env={**_env(), **({"MEGARL_NODE_ADDR": node_addr} if node_addr else {})},
                               stdout=open(trainer_log, "w"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    placed = re.compile(r"megarl: engine replica (\d): pid (\d+) on node (\d+) \(([^)]*)\)")
    namespaces: dict[int, int] = {}  # replica pid → the inode of its network namespace, seen while it ran
    try:
        deadline = time.monotonic() + 1500
        while trainer.poll() is None and time.monotonic() < deadline:
            for _, pid, _, _ in placed.findall(trainer_log.read_text()):
                try:
                    namespaces.setdefault(int(pid), os.stat(f"/proc/{pid}/ns/net").st_ino)
                except OSError:
                    pass
            time.sleep(0.5)
        code = trainer.wait(max(1.0, deadline - time.monotonic()))
        host_code = host.wait(60)
        assert wait_until(lambda: not two_hosts.pids("a") and not two_hosts.pids("b"), 30.0), \
            (two_hosts.pids("a"), two_hosts.pids("b"))  # nothing of the run left in either namespace
        tx = two_hosts.tx_bytes("a")
    finally:
        for proc in (trainer, host):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    out, host_out = trainer_log.read_text(), host_log.read_text()
    assert code == 0 and host_code == 0, out[-5000:] + host_out[-3000:]
    assert f"{trainers} processes started by torchrun" in out or trainers == 1, out[-3000:]
    name_b = two_hosts.name["b"]
    assert f"megarl: replica host on node 1 ({name_b})" in host_out, host_out
    assert re.search(rf"linked to trainer rank 0 at {re.escape(ADDR['a'])}:\d+", host_out), host_out
    assert "trainer rank 0's link ended" in host_out, host_out
    where = placed.findall(out)
    assert sorted(k for k, *_ in where) == ["0", "1"] and all(n == "1" and h == name_b for _, _, n, h in where), where
    assert {int(p) for _, p, _, _ in where} <= set(namespaces), (where, namespaces)
    assert set(namespaces.values()) == {two_hosts.net_inode("b")}, namespaces  # the replicas ran in B
    assert f"step {steps}/{steps} |" in out and "eval after RL: pass@1" in out, out[-3000:]
    rows = _metrics(run_dir)
    gaps = [r["sync/logprob_gap"] for r in rows if "sync/logprob_gap" in r]
    assert len(gaps) >= steps and max(gaps) <= 1e-4, rows  # B's replicas serve the trainer's weights
    sent = sum(r.get("sync/bytes", 0) for r in rows)
    assert sent > 0 and tx >= sent, (tx, sent)  # every byte of every sync went out of A by the veth


DEDICATED = ["engine.placement=disaggregated", "engine.replicas=2", "engine.replica_nodes=1",
             "engine.replica_nodes_dedicated=true"]


def test_outside_slurm_the_host_s_node_index_is_asked_for_and_checked(tmp_path, monkeypatch, capsys):
    """A non-Slurm launch (torchrun by hand on each machine): a host started without ``--node`` says what to
    pass (exit 2, before waiting for anyone), and one started with a trainer node's index (0, where the engine
    node is 1) is refused by rank 0 at once, naming the valid values."""
    import threading

    from megarl.engines.remote.host import HostPool, connect, main, rendezvous_path

    for key in [k for k in os.environ if k.startswith("SLURM")]:
        monkeypatch.delenv(key)
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["--config", "configs/tiny_cpu.yaml", *DEDICATED, f"train.run_dir={tmp_path}"]) == 2
    finally:
        signal.signal(signal.SIGTERM, before)
    assert "outside Slurm (no SLURM_JOB_NODELIST); pass --node N: the trainer's node count (torchrun's --nnodes) " \
           "for the first engine-only node" in capsys.readouterr().err
    path, links = rendezvous_path(tmp_path), []

    def wrong_host() -> None:
        conn, _ = connect(path, 30)
        conn.send(("host", 0, "b", os.getpid()))
        links.append(conn)

    thread = threading.Thread(target=wrong_host, daemon=True)
    thread.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"hosts that did link said nodes \[0\]; node\(s\) \[0\] are not "
                                           r"engine-only nodes: valid --node values are 1..1 "
                                           r"\(the trainer's 1 node\(s\) come first\)"):
        HostPool(path, 1, 1, "127.0.0.1", 60)
    assert time.monotonic() - start < 30
    thread.join(10)
    for conn in links:
        conn.close()
