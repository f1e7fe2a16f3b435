"""Ending an engine for good: its vLLM workers die with it, and the ``/dev/shm`` rings it leaves are
unlinked once nobody maps or holds them, never before.

Fast: real processes create POSIX shared memory the way vLLM's ``MessageQueue`` does (untracked by
Python's resource tracker) and are killed or kept alive. Slow: a real TP-2 vLLM replica is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megarl.engines.remote import reaper

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir() or not Path("/proc/self/maps").exists(),
                                reason="needs Linux /dev/shm and /proc")

CREATE = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
shm = shared_memory.SharedMemory(name=sys.argv[1], create=True, size=1 << 20)
resource_tracker.unregister(shm._name, "shared_memory")  # as vLLM's rings: nobody unlinks them at a kill
print("ready", flush=True)
time.sleep(600)
"""
HOLD = """
import os, sys, time
fd = os.open("/dev/shm/" + sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)  # open, not (yet) mapped
print("ready", flush=True)
time.sleep(600)
"""


def _start(code: str, name: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, name], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_only_segments_nobody_uses_are_unlinked():
    prefix = f"psm_megarltest_{os.getpid()}_"
    killed, mapped, held = (_start(CREATE, prefix + "killed"), _start(CREATE, prefix + "mapped"),
                            _start(HOLD, prefix + "held"))
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        assert (Path("/dev/shm") / (prefix + "killed")).exists()  # what vLLM's killed engine leaves
        assert reaper.unlink_orphans(prefix, min_age_s=60) == []  # too young to judge
        assert reaper.unlink_orphans(prefix, min_age_s=0) == [prefix + "killed"]
        assert (Path("/dev/shm") / (prefix + "mapped")).exists() and (Path("/dev/shm") / (prefix + "held")).exists()
    finally:
        for proc in (killed, mapped, held):
            proc.kill()
            proc.wait(10)
    assert sorted(reaper.unlink_orphans(prefix, min_age_s=0)) == [prefix + "held", prefix + "mapped"]
    assert not list(Path("/dev/shm").glob(prefix + "*"))


@pytest.mark.slow
def test_a_killed_tp2_replica_leaves_no_worker_and_no_ring_in_dev_shm(tmp_path):
    from megarl.engines.remote.replicas import EngineReplicas
    from megarl.models.tiny import TinyShape, make_tiny_model
    from megarl.types import GenerationRequest

    model = make_tiny_model(tmp_path / "model", TinyShape(family="qwen2"), seed=0)
    before = set(Path("/dev/shm").glob("psm_*"))
    replicas = EngineReplicas(str(model), 1, 2, 64, 0.0625, 4)
    try:
        probe = [GenerationRequest([3, 5, 7, 11], n=1, max_tokens=4, greedy=True)]
        assert len(replicas.generate(probe, seed=0)[0][0].token_ids) == 4
        rings = set(Path("/dev/shm").glob("psm_*")) - before
        assert rings  # vLLM's TP-2 engine talks to its workers through them
        workers = psutil.Process(replicas.clients[0].proc.pid).children(recursive=True)
        assert len(workers) >= 2  # vLLM's TP workers
        time.sleep(2)  # older than unlink_orphans' min_age_s
        replicas._end_all()  # what the keeper does after an engine error: SIGKILL
        assert not replicas.clients[0].proc.is_alive()  # multiprocessing reaped it (not psutil behind its back)
        assert not [w.pid for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
        assert not (set(Path("/dev/shm").glob("psm_*")) - before)
    finally:
        replicas.close()
