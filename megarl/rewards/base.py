"""The reward protocol and how a ``reward.fn`` name becomes a function.

A reward function is ``fn(response: str, answer: str, **row_extras) -> float | dict``:
``row_extras`` are the dataset row's other columns (and ``finish_reason``, 'stop' or 'length', and ``transcript``,
a multi-turn episode's messages, where the function names those parameters); a dict result carries ``score``
and any extra numbers, which are logged as ``reward/<name>`` means. ``reward.fn`` is
a built-in name (``math``, ``exact``, ``addition``; see ``builtin.py``) or a dotted
path ``package.module:function``. Functions run in the sandboxed pool (``pool.py``).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Callable
from typing import Protocol

from megarl.rewards.builtin import BUILTINS, FORMAT


class RewardFn(Protocol):
    def __call__(self, response: str, answer: str, **row_extras) -> float | dict: ...


def load_reward_fn(path: str) -> Callable[..., float | dict]:
    """``'pkg.module:function'`` → the function; a clear error names what is missing and where it was looked for."""
    if ":" not in path:
        raise ValueError(f"reward function {path!r}: expected a built-in ({', '.join(BUILTINS)}) "
                         "or 'package.module:function'")
    return load_dotted(path, "reward.fn")


def load_dotted(path: str, key: str) -> Callable:
    """``'pkg.module:name'`` (the value of config key ``key``) → that callable; a ValueError naming ``key`` says what
    is missing and where it was looked for."""
    if ":" not in path:
        raise ValueError(f"{key}={path!r}: expected 'package.module:name'")
    module_name, attr = path.split(":", 1)
    if "/" in module_name or module_name.endswith(".py"):
        dotted = module_name.removesuffix(".py").strip("/").replace("/", ".")
        raise ValueError(f"{key}={path!r}: {module_name!r} is a file path; name the module with dots, "
                         f"relative to the working directory or PYTHONPATH: {key}={dotted}:{attr}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{key}={path!r}: cannot import {module_name!r} ({exc}); every rank imports it from "
                         f"its working directory (here {os.getcwd()}) or PYTHONPATH: run from the directory that "
                         "holds the package, or add that directory to PYTHONPATH") from None
    except Exception as exc:  # noqa: BLE001  (the user's module raised while being imported)
        tb = traceback.extract_tb(exc.__traceback__)[-1]
        raise ValueError(f"{key}={path!r}: importing {module_name!r} raised {type(exc).__name__}: {exc} "
                         f"({tb.filename}:{tb.lineno})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(f"{key}={path!r}: {module_name} ({getattr(module, '__file__', '?')}) has no callable "
                         f"{attr!r}; it has: {', '.join(names) or 'none'}")
    return fn


def on_cwd_path(load: Callable, *args):
    """``load(*args)`` as a rank resolves it: the working directory is on the path (the workers and the torchrun
    ranks run ``python -m``, which puts it first), then PYTHONPATH."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return load(*args)
    finally:
        if added:
            sys.path.remove(cwd)


def import_reward_fn(path: str) -> Callable[..., float | dict]:
    """``load_reward_fn`` as a rank resolves it (``on_cwd_path``)."""
    return on_cwd_path(load_reward_fn, path)


def optional_args(fn) -> set[str]:
    """Which of the optional arguments ``fn`` names: ``finish_reason`` (the sample's: 'stop', it ended with EOS,
    'length', cut at ``rollout.max_new_tokens``, as DAPO's overlong shaping needs) and ``transcript`` (a multi-turn
    episode's messages after the prompt, ``[{role, content}, ...]``; single-turn: the one assistant message)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return set()
    return {"finish_reason", "transcript"} & set(params)


def check_reward_call(spec: str, extras: dict) -> None:
    """Before launch: a user's ``reward.fn`` imports and accepts ``fn(response, answer, **extras)`` (``extras``:
    a usable row's other columns); ValueError naming ``reward.fn`` otherwise. Built-ins take any extras."""
    if not spec or spec in BUILTINS:
        return
    fn = import_reward_fn(spec)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable without a signature: the run will tell
        return
    try:
        sig.bind("response", "answer", **extras, **{k: None for k in optional_args(fn)})
    except TypeError as exc:
        raise ValueError(f"reward.fn={spec!r}: def {getattr(fn, '__name__', '?')}{sig} cannot be called as "
                         f"fn(response, answer, **row_extras) with this dataset's other columns "
                         f"({', '.join(extras) or 'none'}): {exc}; accept them, e.g. "
                         "def score(response, answer, **row_extras)") from None


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
