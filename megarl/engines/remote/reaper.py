"""Ending a vLLM engine process for good: its workers, and the shared memory it cannot release.

A replica (``replica_process.serve``) with ``tensor_parallel_size > 1`` runs vLLM's worker processes
as its children. Killing the replica alone leaves them running: measured on vLLM CPU, both TP
workers went on spinning (a quarter of a core each) for ~20 s after their parent was SIGKILLed, while
the keeper was already starting new replicas — and on a GPU they keep their memory, so the restarted
replica finds it taken. ``kill_tree`` kills the process and every descendant, found before the
parent dies (an orphan is re-parented and can no longer be found from it).

The engine talks to its workers through ``MessageQueue`` rings in POSIX shared memory
(``/dev/shm/psm_<random>``, ``vllm.distributed.device_communicators.shm_broadcast``; 160 MiB for a
TP-2 replica of the tiny model). The process that created a ring unlinks it when it ends normally;
a killed one cannot, and the ring stays in the node's memory until reboot. The names are random,
so what marks an orphan is that no process maps it or holds it open any more: ``unlink_orphans``
removes this user's ``psm_*`` segments that no process of this user maps or holds open (read from
``/proc/<pid>/maps`` and ``/proc/<pid>/fd``) and that are older than a few seconds (a segment
between ``shm_open`` and its ``mmap`` is held open, and young). Another user's segments are never
touched, nor those a live process of ours still uses (another run's engines on a shared node).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

SHM_DIR = Path("/dev/shm")


def kill_tree(pid: int, wait_s: float = 10.0) -> None:
    """SIGKILL ``pid`` and all its descendants, and wait until the descendants are gone. ``pid`` itself is left
    for its owner to reap (``multiprocessing``'s ``join``): reaped here, its ``is_alive()`` would stay True."""
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs[1:], timeout=wait_s)


def _in_use(uid: int) -> set[str]:
    """Paths under /dev/shm mapped or held open by a process of this user."""
    used: set[str] = set()
    prefix = str(SHM_DIR) + "/"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if proc.stat().st_uid != uid:
                continue
            for line in (proc / "maps").read_text().splitlines():
                at = line.find(prefix)
                if at >= 0:
                    used.add(line[at:].removesuffix(" (deleted)"))
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    used.add(target)
        except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
            continue  # the process ended while we read it, or it is not readable (then it is not ours)
    return used


def unlink_orphans(prefix: str = "psm_", min_age_s: float = 2.0) -> list[str]:
    """Unlink this user's ``/dev/shm/<prefix>*`` segments that no live process maps or holds open.

    Returns the names removed. A no-op where ``/dev/shm`` or ``/proc`` is missing (not Linux)."""
    if not SHM_DIR.is_dir() or not Path("/proc/self/maps").exists():
        return []
    uid, now = os.getuid(), time.time()
    candidates = []
    for path in SHM_DIR.glob(prefix + "*"):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        if st.st_uid == uid and now - st.st_ctime >= min_age_s:
            candidates.append(path)
    if not candidates:
        return []
    used = _in_use(uid)
    removed = []
    for path in candidates:
        if str(path) in used:
            continue
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
    return removed
