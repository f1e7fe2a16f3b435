"""The reward protocol and how a ``reward.fn`` name becomes a function.

A reward function is ``fn(response: str, answer: str, **row_extras) -> float | dict``:
``row_extras`` are the dataset row's other columns; a dict result carries ``score``
and any extra numbers, which are logged as ``reward/<name>`` means. ``reward.fn`` is
a built-in name (``math``, ``exact``, ``addition``; see ``builtin.py``) or a dotted
path ``package.module:function``. Functions run in the sandboxed pool (``pool.py``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Protocol

from megarl.rewards.builtin import BUILTINS, FORMAT


class RewardFn(Protocol):
    def __call__(self, response: str, answer: str, **row_extras) -> float | dict: ...


def load_reward_fn(path: str) -> Callable[..., float | dict]:
    """``'pkg.module:function'`` → the function; a clear error names what is missing."""
    if ":" not in path:
        raise ValueError(f"reward function {path!r}: expected a built-in ({', '.join(BUILTINS)}) "
                         "or 'package.module:function'")
    module_name, attr = path.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward function {path!r}: cannot import {module_name!r} ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function {path!r}: {module_name} has no callable {attr!r}")
    return fn


def resolve_reward(spec: str, format_coef: float = 0.0) -> Callable[..., float | dict]:
    """The function ``reward.fn`` names, with the built-in's format bonus/penalty folded in."""
    if spec in BUILTINS:
        fn, check = BUILTINS[spec], FORMAT[spec]
        if not format_coef:
            return fn

        def with_format(response: str, answer: str, **extras) -> dict:
            ok, correct = check(response), fn(response, answer, **extras)
            return {"score": correct + (format_coef if ok else -format_coef), "format": float(ok), "correct": correct}

        return with_format
    if format_coef:
        raise ValueError(f"reward.format_coef applies to the built-in rewards ({', '.join(BUILTINS)}); "
                         f"{spec!r} should fold its own format term into its score")
    return load_reward_fn(spec)
