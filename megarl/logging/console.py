"""megarl's console: every module logs through ``logging.getLogger(__name__)``; ``configure`` sends the ``megarl``
loggers to the terminal, one plain line per record (what a user reads in a job's log): INFO to stdout, WARNING and
above to stderr. Called by every entry point (the CLI, a session's build, a replica process, a replica host);
idempotent. The step's progress line is the metrics logger's own (``metrics.MetricsLogger.progress``)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from megarl.distributed.collectives import rank_and_world


class _Below(logging.Filter):
    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


class _Console(logging.StreamHandler):
    """A handler writing to whatever ``sys.stdout``/``sys.stderr`` is at the time of the record (a test's capture,
    a redirect made after ``configure``), not the stream that was current when it was attached."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name_of_stream = name

    @property
    def stream(self):
        return getattr(sys, self.name_of_stream)

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it; the property always reads sys
        pass


def _plain(stream: str, level: int = logging.NOTSET, keep=None) -> _Console:
    """A handler of one plain line per record (the message alone) to ``stream``, from ``level``, for the records
    ``keep`` (a filter) passes."""
    handler = _Console(stream)
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter("%(message)s"))
    if keep is not None:
        handler.addFilter(keep)
    return handler


def configure(level: int = logging.INFO) -> None:
    """Attach megarl's two console handlers once per process (stdout below WARNING, stderr from it).

    A root logger without handlers gets one too, for other libraries' warnings (what logging's last resort would
    print) and never megarl's: a library's root-level ``logging.debug(...)`` otherwise runs ``basicConfig`` and
    every megarl record, propagating, is printed a second time as ``INFO:megarl...`` (vLLM's CPU MoE kernel does,
    on AMD hosts: ``zentorch_utils.is_zentorch_moe_supported``)."""
    megarl = logging.getLogger("megarl")
    megarl.setLevel(level)
    if any(getattr(h, "megarl_console", False) for h in megarl.handlers):
        return
    if not logging.root.handlers:
        ours = logging.Filter("megarl")  # (passes the megarl logger's records and its children's)
        logging.root.addHandler(_plain("stderr", logging.WARNING, lambda record: not ours.filter(record)))
    for handler in (_plain("stdout", keep=_Below(logging.WARNING)), _plain("stderr", logging.WARNING)):
        handler.megarl_console = True
        megarl.addHandler(handler)


def main_only(say: Callable[[str], None], rank: int | None = None) -> Callable[[str], None]:
    """``say`` on rank 0 (``rank``: this process's, by default the process group's), a no-op elsewhere: for lines
    every rank reaches alike and one rank should say."""
    return say if (rank_and_world()[0] if rank is None else rank) == 0 else (lambda *args, **kwargs: None)
