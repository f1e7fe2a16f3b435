"""Every patch of a dependency's internals, one module per library (``megatron``, ``vllm``, ``torch``), each written
for one version: ``require`` refuses any other loudly, naming both, before a patch is applied."""

from __future__ import annotations

import functools

MEGATRON_CORE = "0.16.1"
"""The megatron-core every patch of it is written for (``compat.megatron``, ``compat.lazy_compile``)."""


@functools.cache
def require(library: str, written_for: str) -> None:
    """Raise unless ``library`` ('megatron-core', 'vllm' or 'torch') is at version ``written_for``: a patch of its
    internals would break silently at another."""
    if library == "megatron-core":
        from megatron.core import __version__ as have
    elif library == "vllm":
        from vllm import __version__ as have
    elif library == "torch":
        from torch import __version__ as have
    else:
        raise ValueError(f"no version check for {library!r}")
    if have.split("+")[0] != written_for:
        raise RuntimeError(f"megarl/compat patches {library} {written_for}'s internals, but {library} {have} is "
                           f"installed: install {library}=={written_for} (setup.py pins it), or port the patches in "
                           "megarl/compat/ to the new version")
