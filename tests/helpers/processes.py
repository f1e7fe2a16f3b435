"""Helpers shared by the ``*_checks.py`` scripts that the tests run in subprocesses."""

from __future__ import annotations


def record_drawn(controller) -> set[int]:
    """Make ``controller`` note the index of every prompt it draws; return the set it fills."""
    drawn: set[int] = set()
    source = controller.next_prompt

    def counted():
        item = source()
        if item is not None:
            drawn.add(item.index)
        return item

    controller.next_prompt = counted
    return drawn


def ended_or_killed(pid: int, wait_s: float = 5.0) -> bool:
    """True if process ``pid`` ends within ``wait_s``; else SIGKILL it (nothing left behind) and return False."""
    import os
    import signal
    import time

    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return False


def wait_until(cond, timeout: float = 10.0) -> bool:
    """Poll ``cond()`` every 50 ms until it is true or ``timeout`` seconds passed; its last value."""
    import time

    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.05)
    return cond()


def processes_with_env(entry: str) -> list[str]:
    """'pid command line' of every process whose environment holds ``entry`` ('KEY=value'), e.g. everything a
    test's run started, whoever spawned it (a process that ended meanwhile, or is not ours to read, is skipped)."""
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if entry.encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid} {command[:200]}")
        except OSError:
            continue
    return found


def end_process_group() -> None:
    """A worker's last collective step, as ``megarl train`` ends (``distributed.bootstrap.end_distributed``)."""
    from megarl.distributed.bootstrap import end_distributed

    end_distributed()
