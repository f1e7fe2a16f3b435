"""The environment protocol and how an ``env.fn`` name becomes a class.

An environment is a class named ``package.module:Class`` (``env.fn``)::

    class Env:
        def __init__(self, **row_extras): ...          # the dataset row's other columns, as a reward gets them
        def step(self, response: str) -> str | dict | None: ...

One instance per sample, built when its first model turn ends. ``step`` gets the model's turn (its text, special
tokens left out) and answers with the next message: a string is a tool result (``{"role": "tool", "content": s}``),
a dict is a chat message ``{"role": "tool" | "user", "content": str}``, ``None`` ends the episode. Anything else is
a wrong type: the episode ends and counts in ``env/errors``. ``env.max_turns`` bounds the model turns,
``env.timeout_s`` each call; instances run in the sandboxed worker pool (``pool.py``), never in the trainer.
``env.fn: tools`` is the built-in tool environment (``tools.py``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from megarl.envs.tools import ToolEnv, load_tools
from megarl.rewards.base import load_dotted, on_cwd_path

ROLES = ("tool", "user")
BUILTIN = "tools"
"""``env.fn``'s built-in: the tool environment (``tools.py``) over the functions ``env.tools`` names."""


class EnvReplyError(ValueError):
    """A ``step`` result that is neither a string, a ``{"role": "tool" | "user", "content": str}`` dict nor None."""


def load_env_class(spec: str) -> type:
    """``'pkg.module:Class'`` → the class, with a callable ``step``; ValueError naming ``env.fn`` otherwise."""
    cls = load_dotted(spec, "env.fn")
    if not inspect.isclass(cls):
        raise ValueError(f"env.fn={spec!r} names a {type(cls).__name__}, not a class; an environment is a class "
                         "built per sample from the row's columns, with a method step(self, response) -> "
                         "str | dict | None")
    if not callable(getattr(cls, "step", None)):
        raise ValueError(f"env.fn={spec!r}: class {cls.__name__} has no method step(self, response) -> "
                         "str | dict | None")
    return cls


def import_env_class(spec: str) -> type:
    """``load_env_class`` as a worker resolves it (the working directory first, then PYTHONPATH)."""
    return on_cwd_path(load_env_class, spec)


def resolve_env(spec: str, tools: str = "") -> Callable[..., object]:
    """What builds an episode's environment from its row: the built-in tool environment (``env.fn: tools``, with
    ``env.tools``) or the class ``env.fn`` names."""
    if spec == BUILTIN:
        return functools.partial(ToolEnv, load_tools(tools))
    return import_env_class(spec)


def check_env_call(spec: str, extras: dict, tools: str = "") -> None:
    """Before launch: ``env.fn`` imports, is a class built as ``Class(**extras)`` (``extras``: a usable row's other
    columns) whose ``step`` takes one response; the built-in's ``env.tools`` import; ValueError naming the key."""
    if spec == BUILTIN:
        load_tools(tools)
        return
    cls = import_env_class(spec)
    for what, fn, args in (("__init__", cls, ()), ("step", cls.step, (None, "response"))):
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin or C callable without a signature: the run will tell
            continue
        try:
            sig.bind(*args, **(extras if what == "__init__" else {}))
        except TypeError as exc:
            call = (f"{cls.__name__}(**row_extras) with this dataset's other columns ({', '.join(extras) or 'none'})"
                    if what == "__init__" else "step(self, response)")
            raise ValueError(f"env.fn={spec!r}: {cls.__name__}.{what}{sig} cannot be called as {call}: {exc}; "
                             "accept them, e.g. def __init__(self, **row_extras)") from None


def as_message(reply) -> dict | None:
    """A ``step`` result as the chat message it stands for (None: the episode ends); ``EnvReplyError`` otherwise."""
    if reply is None:
        return None
    if isinstance(reply, str):
        return {"role": "tool", "content": reply}
    if isinstance(reply, dict):
        role, content = reply.get("role"), reply.get("content")
        if role in ROLES and isinstance(content, str) and set(reply) == {"role", "content"}:
            return {"role": role, "content": content}
        raise EnvReplyError(f"step returned the dict {reply!r:.120}; a message is exactly "
                            "{'role': 'tool' | 'user', 'content': str}")
    raise EnvReplyError(f"step returned {type(reply).__name__} {reply!r:.80}; valid: a str (a tool result), "
                        "a {'role': 'tool' | 'user', 'content': str} dict, or None (the episode ends)")
