"""The reward protocol and a runner that never lets a reward function crash the loop.

A reward function is ``fn(response: str, answer: str) -> float``. User functions
are named by dotted path (``package.module:function``). The runner scores a batch
in a thread pool with a per-call timeout; a function that raises or runs past it
scores 0 and is counted (``errors`` / ``timeouts``) and logged once per step.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import logging
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)


class RewardFn(Protocol):
    def __call__(self, response: str, answer: str) -> float: ...


def load_reward_fn(path: str) -> Callable[[str, str], float]:
    """``'pkg.module:function'`` → the function; a clear error names what is missing."""
    if ":" not in path:
        raise ValueError(f"reward function {path!r}: expected 'package.module:function'")
    module_name, attr = path.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward function {path!r}: cannot import {module_name!r} ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {path!r}: {module_name} has no callable {attr!r}")
    return fn


class RewardRunner:
    """Scores (response, answer) pairs with ``fn``; contains exceptions and timeouts."""

    def __init__(self, fn: Callable[[str, str], float], timeout_s: float = 5.0, workers: int = 4) -> None:
        self.fn, self.timeout_s = fn, timeout_s
        self.pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")
        self.errors = 0
        self.timeouts = 0

    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        futures = [self.pool.submit(self.fn, r, a) for r, a in pairs]
        scores, errors, timeouts = [], 0, 0
        for fut in futures:
            try:
                scores.append(float(fut.result(timeout=self.timeout_s)))
            except cf.TimeoutError:
                timeouts += 1
                scores.append(0.0)
            except Exception as exc:  # a user reward must not crash the run
                errors += 1
                scores.append(0.0)
                last = exc
        if errors:
            log.warning("reward: %d of %d calls raised (last: %r); scored 0", errors, len(pairs), last)
        if timeouts:
            log.warning("reward: %d of %d calls timed out after %.1fs; scored 0", timeouts, len(pairs), self.timeout_s)
        self.errors += errors
        self.timeouts += timeouts
        return scores
