"""Test environments the environment tests name by dotted path (``helpers.envs:NAME``); they run in the pool."""

import os
import time


class Countdown:
    """A multi-turn task: answers ``turns - 1`` model turns (a tool result, then a user message, alternating) and ends
    the episode after the ``turns``-th; a row's ``mode`` makes it fail: 'raise', 'hang', 'type' (returns an int),
    'exit' (kills its worker). Each episode's first call notes the process it runs in (``instance_pid``)."""

    def __init__(self, turns: int = 2, mode: str = "ok", **_) -> None:
        self.turns, self.mode, self.seen, self.pid = int(turns), mode, 0, os.getpid()

    def step(self, response: str):
        self.seen += 1
        if self.mode == "raise":
            raise RuntimeError("the tool broke")
        if self.mode == "hang":
            time.sleep(10**6)
        if self.mode == "type":
            return 42
        if self.mode == "exit":
            os._exit(3)
        if self.seen >= self.turns:
            return None
        if self.seen % 2:
            return f"tool: turn {self.seen} had {len(response)} chars"
        return {"role": "user", "content": f"go on ({self.pid})"}


class Slow(Countdown):
    """``Countdown`` whose every answer takes ``SLOW_ENV_S`` seconds (a slow tool)."""

    def step(self, response: str):
        time.sleep(float(os.environ.get("SLOW_ENV_S", "0.5")))
        return super().step(response)


class NoStep:
    """A class without ``step``: refused before launch."""


def not_a_class(response: str) -> str:
    return response


def transcript_turns(response: str, answer: str, transcript: list, **_) -> dict:
    """A reward that reads the whole conversation: 1.0 for an episode of ≥ 2 model turns; the turns as a metric."""
    turns = sum(m["role"] == "assistant" for m in transcript)
    return {"score": float(turns >= 2), "turns": float(turns)}


class Strict(Countdown):
    """Built from ``turns`` alone: a row with other columns cannot build it."""

    def __init__(self, turns: int = 2) -> None:
        super().__init__(turns)


class Rotating(Countdown):
    """``Countdown`` of two turns whose episodes, in the order a worker builds them, go: ok, raise, ok, wrong type,
    ok, hang (the end-to-end run's faults, with any dataset: the built-in task's rows have no columns)."""

    built = 0

    def __init__(self, **row) -> None:
        Rotating.built += 1
        super().__init__(2, ("ok", "raise", "ok", "type", "ok", "hang")[(Rotating.built - 1) % 6])


def multiply(a: int, b: int) -> int:
    """The product of two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def lookup(key: str) -> dict:
    """A constant's value (a dict result; an unknown key raises KeyError).

    Args:
        key: the constant's name
    """
    return {"pi": {"value": 3.14159}}[key]


def undocumented(x: int) -> int:
    return x


class Unpicklable(Slow):
    """``Slow`` holding a lock: its instances cannot be pickled (a resume restarts their episodes)."""

    def __init__(self, **row) -> None:
        import threading

        super().__init__(**row)
        self.guard = threading.Lock()


class Sleepy(Countdown):
    """``Countdown`` whose every answer takes the row's ``delay`` seconds (a prompt with a slow tool)."""

    def __init__(self, delay: float = 0.0, **row) -> None:
        super().__init__(**row)
        self.delay = float(delay)

    def step(self, response: str):
        time.sleep(self.delay)
        return super().step(response)
