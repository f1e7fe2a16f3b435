"""megatron-core's import without torch's compiler: ~1.5 s off the start of every process that imports it.

``megatron.core.jit`` binds ``jit_fuser = torch.compile`` and megatron decorates a dozen fused kernels with it while
its package body runs. Decorating alone imports torch's dynamo and inductor (1.4-1.5 s on a 2-core host, every
trainer rank and every test worker), for functions megarl's layers do not call (``trainer/model.py`` turns the bias,
dropout, softmax and RoPE fusions off). While ``megatron.core``'s package body runs, ``torch.compile`` given a
function returns a stand-in that compiles it with the same arguments on its first call: what runs is what
megatron would run, only the compiler's import moves to the first call (and never happens when nothing calls one).
``torch.compile`` is restored when the package body returns; modules, and every later caller, get it unchanged.

``install()`` (from ``megarl/__init__``) adds an import hook and imports nothing: processes that never import
megatron pay nothing. Written for megatron-core 0.16.1's ``jit.py``; any other version keeps the stock import.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any

from megarl.compat import MEGATRON_CORE


def _on_first_call(compile_: Callable, fn: Callable, kwargs: dict) -> Callable:
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def run(*args: Any, **kw: Any) -> Any:
        if not compiled:
            compiled.append(compile_(fn, **kwargs))
        return compiled[0](*args, **kw)

    run.__wrapped_uncompiled__ = fn  # type: ignore[attr-defined]
    return run


def deferring(compile_: Callable) -> Callable:
    """``compile_`` (``torch.compile``) with the compilation of plain functions moved to their first call."""

    def deferred(model: Callable | None = None, **kwargs: Any) -> Any:
        if model is None:  # used as @torch.compile(...)
            return lambda fn: deferred(fn, **kwargs)
        if not callable(model) or hasattr(model, "parameters"):  # a module: compiled now, as asked
            return compile_(model, **kwargs)
        return _on_first_call(compile_, model, kwargs)

    return deferred


class _Loader(importlib.abc.Loader):
    """The package's own loader; its body runs with ``torch.compile`` deferring."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        import torch

        real = torch.compile
        torch.compile = deferring(real)
        try:
            self._loader.exec_module(module)
        finally:
            torch.compile = real

    def __getattr__(self, name: str) -> Any:  # resource readers, get_filename, ...
        return getattr(self._loader, name)


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "megatron.core":
            return None
        sys.meta_path.remove(self)  # once: the package body runs a single time
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not _written_for():
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


def _written_for() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core") == MEGATRON_CORE
    except PackageNotFoundError:
        return False


def install() -> None:
    """Add the hook unless ``megatron.core`` is imported already (or the hook is in)."""
    if "megatron.core" not in sys.modules and not any(isinstance(h, _Hook) for h in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
