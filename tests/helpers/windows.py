"""Delays inside the checkpoint windows: the places where rank 0's generating thread changes what a run checkpoint
keeps outside the engines' gate (``docs/checkpoints-and-faults.md``, "What a checkpoint holds"). Each window is
named, and made slow by wrapping a call that runs inside it (nothing is wrapped unless a test asks: the product's
code holds no check of its own, as ``megarl/testing/faults.py``'s hooks).

- ``expire_stale``: a stale group dropped (``PromptBuffer.expire_stale``, ``rollout.stale_action=drop``): between
  its leaving the live set and its prompt re-queued (``forget_time``). ``room``: the controller.
- ``sweep``: an episode resumed before a phase (``Episodes.sweep``): between its instance leaving what the loaded
  checkpoint handed back and its joining what the next checkpoint keeps (``restore.pop``). ``room``: the episodes.
- ``phase_restore``: a failed phase put back (``PhaseRunner``): between the controller's state loaded back and the
  prompts the phase drew re-queued (``load_state_dict``). ``room``: the controller.
- ``hand_over``: a phase generated ahead (``Pipeline``): between its end (the engines' gate let go) and its batch in
  the queue (``PhaseRunner``'s figures: ``rewards.step_metrics``). ``room``: the phase runner's rewards.
"""

from __future__ import annotations

import functools
import threading

WINDOWS = ("expire_stale", "sweep", "phase_restore", "hand_over")


class Window:
    """A slowed window: ``entered`` is set once the generating thread is in it; it stays there ``seconds`` at most,
    or until ``leave()``."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.entered, self._left = seconds, threading.Event(), threading.Event()

    def delay(self) -> None:
        if not self.entered.is_set():  # (the first time only)
            self.entered.set()
            self._left.wait(self.seconds)

    def leave(self) -> None:
        self._left.set()


def slow(window: str, room, seconds: float) -> Window:
    """Make ``window`` (in ``room``) last up to ``seconds`` more, the first time it is entered."""
    if window not in WINDOWS:
        raise ValueError(f"no checkpoint window {window!r}; the windows: {', '.join(WINDOWS)}")
    w = Window(seconds)
    if window == "sweep":
        room.restore = _SlowPop(room.restore, w.delay)
        return w
    name, after = {"expire_stale": ("forget_time", False), "phase_restore": ("load_state_dict", True),
                   "hand_over": ("step_metrics", False)}[window]
    inner = getattr(room, name)

    @functools.wraps(inner)
    def slowed(*args, **kwargs):
        if not after:
            w.delay()
        out = inner(*args, **kwargs)
        if after:
            w.delay()
        return out

    setattr(room, name, slowed)
    return w


class _SlowPop(dict):
    """A dict whose ``pop`` of a present key waits after taking it out."""

    def __init__(self, items: dict, delay) -> None:
        super().__init__(items)
        self._delay = delay

    def pop(self, key, *default):
        present = key in self
        out = super().pop(key, *default)
        if present:
            self._delay()
        return out
