"""Prompt sources behind one interface: a user's dataset, or the built-in addition task.

A source hands out ``Prompt``s (``next()``), the held-out ``eval_prompts()``, its
metrics (``data/epoch``, ``data/bad_rows``, ``data/prompts_too_long``) and its
position as a ``state_dict()`` that a run checkpoint saves.

``DatasetSource`` walks its rows epoch by epoch; epoch ``e`` visits the rows in the
order ``permutation(n)`` of a NumPy generator seeded with ``(seed, e)``, so the whole
cursor is ``(epoch, position)``: resuming replays nothing and skips nothing. A row
whose prompt or answer is unusable is a *bad row*: under ``on_bad_row: skip`` it is
counted and the first few are logged with file and line/row; under ``error`` every
row is checked when the source opens, and the first bad one stops the run with a
message naming file, line/row and field. A prompt longer than ``max_prompt_tokens``
after rendering is dropped and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from megarl.data import encode
from megarl.data.chat import PromptRenderer
from megarl.data.checks import check_keys, check_rows
from megarl.data.readers import RowStore
from megarl.data.rows import DataError, Keys, keys_of, parse_and_render

log = logging.getLogger(__name__)

LOG_FIRST_BAD = 5


@dataclass
class Prompt:
    """One prompt: stable index, rendered text and ids, reference answer, the row's other columns."""

    index: int
    ids: list[int]
    text: str
    answer: str
    extras: dict = field(default_factory=dict)
    key: object = None


class DatasetSource:
    """Prompts from a dataset (``RowStore``), rendered by ``render(prompt) -> (text, ids)``."""

    def __init__(self, store: RowStore, render: Callable, keys: Keys = Keys(), max_prompt_tokens: int = 0,
                 on_bad_row: str = "skip", seed: int = 0, shuffle: bool = True, eval_store: RowStore | None = None,
                 eval_size: int = 0, eval_keys: Keys | None = None) -> None:
        if on_bad_row not in ("skip", "error"):
            raise ValueError(f"data.on_bad_row must be 'skip' or 'error', got {on_bad_row!r}")
        self.store, self.render, self.keys, self.eval_keys = store, render, keys, eval_keys or keys
        self.max_prompt_tokens, self.on_bad_row, self.seed, self.shuffle = max_prompt_tokens, on_bad_row, seed, shuffle
        self.eval_store, self.eval_size = eval_store, eval_size
        for s, k, key in ((store, self.keys, "data.path"), (eval_store, self.eval_keys, "data.eval_path")):
            if s is not None:
                check_keys(s, k, key)
                if on_bad_row == "error":
                    check_rows(s, k, render)
        self.epoch, self.pos, self.served = 0, 0, 0
        self.bad_rows, self.too_long, self.last_refusal = 0, 0, ""
        self._logged: set[str] = set()
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> np.ndarray:
        n = len(self.store)
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def _prompt(self, store: RowStore, keys: Keys, i: int, index: int) -> Prompt | None:
        """Row ``i`` as a Prompt; None (counted) when it is bad or too long."""
        where, row = store.row(i)
        try:
            answer, extras, (text, ids) = parse_and_render(row, where, keys, self.render)
        except DataError as exc:
            msg = str(exc)
            if self.on_bad_row == "error":
                raise DataError(msg) from None
            self.bad_rows += 1
            self.last_refusal = msg
            if len(self._logged) < LOG_FIRST_BAD and where not in self._logged:
                self._logged.add(where)
                log.warning("data: skipping bad row %s (data.on_bad_row=skip)", msg)
            return None
        if self.max_prompt_tokens and len(ids) > self.max_prompt_tokens:
            self.too_long += 1
            self.last_refusal = (f"{where}: the prompt has {len(ids)} tokens, more than data.max_prompt_tokens="
                                 f"{self.max_prompt_tokens}")
            return None
        return Prompt(index, ids, text, answer, extras, key=text)

    def next(self) -> Prompt:
        """The next usable prompt of the epoch walk; a walk over every row that finds none is an error (nothing to
        train on; the counts in its message are of that walk alone)."""
        bad, too_long = self.bad_rows, self.too_long
        for _ in range(len(self.store)):
            if self.pos >= len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._order_of(self.epoch)
            i = int(self._order[self.pos])
            self.pos += 1
            item = self._prompt(self.store, self.keys, i, self.served)
            if item is not None:
                self.served += 1
                return item
        raise DataError(f"data.path={self.store.spec!r}: none of its {len(self.store)} rows is usable "
                        f"({self.bad_rows - bad} bad, {self.too_long - too_long} longer than data.max_prompt_tokens="
                        f"{self.max_prompt_tokens}); last refused: {self.last_refusal}")

    def eval_prompts(self) -> list[Prompt]:
        """The first ``eval_size`` usable rows of ``eval_path`` (all when 0), in file order."""
        if self.eval_store is None:
            return []
        out: list[Prompt] = []
        for i in range(len(self.eval_store)):
            item = self._prompt(self.eval_store, self.eval_keys, i, len(out))
            if item is not None:
                out.append(item)
                if self.eval_size and len(out) == self.eval_size:
                    break
        return out

    def metrics(self) -> dict[str, float]:
        return {"data/epoch": self.epoch + self.pos / len(self._order), "data/bad_rows": float(self.bad_rows),
                "data/prompts_too_long": float(self.too_long)}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "served": self.served, "seed": self.seed,
                "bad_rows": self.bad_rows, "too_long": self.too_long, "rows": len(self.store)}

    def load_state_dict(self, state: dict) -> None:
        if state["rows"] != len(self.store) or state["seed"] != self.seed:
            raise DataError(f"data cursor was saved for {state['rows']} rows and seed {state['seed']}; "
                            f"{self.store.spec!r} has {len(self.store)} rows and data.seed is {self.seed}")
        self.epoch, self.pos, self.served = state["epoch"], state["pos"], state["served"]
        self.bad_rows, self.too_long = state["bad_rows"], state["too_long"]
        self._order = self._order_of(self.epoch)


class AdditionSource:
    """The built-in addition task behind the same interface; prompts are the task's raw completions."""

    def __init__(self, task, tokenizer) -> None:
        self.task, self.tokenizer, self.served = task, tokenizer, 0

    def _prompt(self, problem, index: int) -> Prompt:
        return Prompt(index, encode(self.tokenizer, problem.prompt), problem.prompt, problem.answer, key=problem.prompt)

    def next(self) -> Prompt:
        self.served += 1
        return self._prompt(self.task.next_problem(), self.served - 1)

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(p, i) for i, p in enumerate(self.task.eval_problems)]

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {"cursor": self.task.cursor, "served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.task.skip_to(state["cursor"])
        self.served = state["served"]


def build_prompts(d, tokenizer, task=None, default_max_prompt_tokens: int = 0, tools: list | None = None):
    """The prompt source ``data.*`` asks for: the dataset at ``data.path``, else the built-in ``task``; ``tools``:
    the functions its chat template describes (``PromptRenderer``)."""
    if not d.path:
        return AdditionSource(task, tokenizer)
    render = PromptRenderer(tokenizer, d.chat_template, d.system_prompt, tools, d.enable_thinking)
    eval_store = RowStore(d.eval_path, "data.eval_path") if d.eval_path else None
    return DatasetSource(RowStore(d.path), render, keys_of(d), d.max_prompt_tokens or default_max_prompt_tokens,
                         d.on_bad_row, d.seed, d.shuffle, eval_store, d.eval_size, keys_of(d, "data.eval_path"))
