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

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from megarl.data import encode
from megarl.data.chat import PromptError
from megarl.data.readers import MISSING, BadRow, RowStore, get_field

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


class DataError(ValueError):
    """A dataset problem found before training; the message names file, line/row and field."""


def parse_row(row: dict | BadRow, where: str, prompt_key: str, answer_key: str) -> tuple[object, str, dict]:
    """``(prompt, answer, extras)`` of a row, or DataError naming where and which field is wrong.

    A key may be a column or a dotted path into nested (struct) fields, such as verl's
    ``reward_model.ground_truth``. ``answer_key`` equal to ``prompt_key`` reads a conversation (TRL's ``messages``):
    the prompt is every message before the last assistant turn and the answer is that turn's content.
    A conversation with a separate answer column loses its trailing assistant turns (``without_trailing_answer``).
    ``extras`` are the row's other top-level columns (a nested answer's column stays in them)."""
    if isinstance(row, BadRow):
        raise DataError(f"{where}: {row.why}")
    prompt = get_field(row, prompt_key)
    if prompt is MISSING or prompt is None:
        raise DataError(f"{where}: field {prompt_key!r} (data.prompt_key) is missing or null")
    if answer_key == prompt_key:
        prompt, answer = split_conversation(prompt, where, prompt_key)
    else:
        answer = get_field(row, answer_key)
        prompt = without_trailing_answer(prompt, prompt_key)
    if answer is MISSING or answer is None or isinstance(answer, (dict, list)):
        shown = None if answer is MISSING else answer
        hint = (f"; name one of its fields with a dotted key: {', '.join(repr(f'{answer_key}.{k}') for k in answer)}"
                if isinstance(answer, dict) and answer else "")
        raise DataError(f"{where}: field {answer_key!r} (data.answer_key) must be a string or number, got "
                        f"{shown!r:.60}{hint}")
    extras = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
    return prompt, str(answer), extras


def without_trailing_answer(prompt, key: str):
    """A conversation that ends with assistant turns (OpenAI/TRL ``messages`` beside a separate answer column) less
    those turns: they hold the reference response, which the prompt would hand the policy. Said once per key."""
    if not isinstance(prompt, (list, tuple)):
        return prompt
    end = len(prompt)
    while end and isinstance(prompt[end - 1], dict) and prompt[end - 1].get("role") == "assistant":
        end -= 1
    if end < len(prompt):
        _say_trimmed(key)
    return list(prompt[:end])


@functools.cache  # once per key and process
def _say_trimmed(key: str) -> None:
    log.warning("data: field %r holds conversations that end with an assistant turn (the reference response): the "
                "prompt is the messages before it (set data.answer_key=%s to take that turn as the answer)", key, key)


def split_conversation(messages, where: str, key: str) -> tuple[list, str]:
    """A conversation → (the messages before its last assistant turn, that turn's content)."""
    last = -1
    if isinstance(messages, (list, tuple)):
        last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
                   default=-1)
    if last < 1:
        raise DataError(f"{where}: field {key!r} (data.prompt_key = data.answer_key: a conversation whose last "
                        "assistant turn is the answer) must be a list of messages with an assistant turn after at "
                        f"least one other message, got {messages!r:.80}")
    return list(messages[:last]), messages[last].get("content")


class DatasetSource:
    """Prompts from a dataset (``RowStore``), rendered by ``render(prompt) -> (text, ids)``."""

    def __init__(self, store: RowStore, render: Callable, prompt_key: str = "prompt", answer_key: str = "answer",
                 max_prompt_tokens: int = 0, on_bad_row: str = "skip", seed: int = 0, shuffle: bool = True,
                 eval_store: RowStore | None = None, eval_size: int = 0) -> None:
        if on_bad_row not in ("skip", "error"):
            raise ValueError(f"data.on_bad_row must be 'skip' or 'error', got {on_bad_row!r}")
        self.store, self.render, self.prompt_key, self.answer_key = store, render, prompt_key, answer_key
        self.max_prompt_tokens, self.on_bad_row, self.seed, self.shuffle = max_prompt_tokens, on_bad_row, seed, shuffle
        self.eval_store, self.eval_size = eval_store, eval_size
        for s, key in ((store, "data.path"), (eval_store, "data.eval_path")):
            if s is not None:
                check_keys(s, prompt_key, answer_key, key)
                if on_bad_row == "error":
                    check_rows(s, prompt_key, answer_key, render)
        self.epoch, self.pos, self.served = 0, 0, 0
        self.bad_rows, self.too_long, self.last_refusal = 0, 0, ""
        self._logged: set[str] = set()
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> np.ndarray:
        n = len(self.store)
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def _prompt(self, store: RowStore, i: int, index: int) -> Prompt | None:
        """Row ``i`` as a Prompt; None (counted) when it is bad or too long."""
        where, row = store.row(i)
        try:
            prompt, answer, extras = parse_row(row, where, self.prompt_key, self.answer_key)
            text, ids = self.render(prompt)
        except (DataError, PromptError) as exc:
            msg = str(exc) if isinstance(exc, DataError) else f"{where}: field {self.prompt_key!r} {exc}"
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
            item = self._prompt(self.store, i, self.served)
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
            item = self._prompt(self.eval_store, i, len(out))
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


def check_keys(store: RowStore, prompt_key: str, answer_key: str, key: str = "data.path") -> None:
    section = key.split(".")[0]
    for name, k in ((f"{section}.prompt_key", prompt_key), (f"{section}.answer_key", answer_key)):
        if not store.has_key(k):
            raise DataError(f"{key}={store.spec!r}: no row has the key {k!r} ({name}); set {name} to the column "
                            f"that holds it (a dotted key reads a nested field); the rows have: "
                            f"{', '.join(store.column_names()) or 'no columns'}")


SHOWN_BAD_ROWS = 10
"""Bad rows ``check_rows`` names in its error (it counts them all): a file's problems are fixed in one round."""


def check_rows(store: RowStore, prompt_key: str, answer_key: str, render: Callable | None = None) -> None:
    """Every row parses (and renders, given ``render``); else DataError naming the first ``SHOWN_BAD_ROWS`` bad
    rows and counting them all."""
    bad: list[str] = []
    count = 0
    for i in range(len(store)):
        where, row = store.row(i)
        try:
            prompt, _, _ = parse_row(row, where, prompt_key, answer_key)
            render(prompt) if render is not None else None
        except DataError as exc:
            problem = str(exc)
        except PromptError as exc:
            problem = f"{where}: field {prompt_key!r} {exc}"
        else:
            continue
        count += 1
        if len(bad) < SHOWN_BAD_ROWS:
            bad.append(problem)
    if count == 1:
        raise DataError(f"{bad[0]} (data.on_bad_row=error)")
    if count:
        more = f"; {count - len(bad)} more" if count > len(bad) else ""
        raise DataError(f"{count} bad rows (data.on_bad_row=error): " + "; ".join(bad) + more)


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


def build_prompts(d, tokenizer, task=None, default_max_prompt_tokens: int = 0):
    """The prompt source ``data.*`` asks for: the dataset at ``data.path``, else the built-in ``task``."""
    if not d.path:
        return AdditionSource(task, tokenizer)
    from megarl.data.chat import PromptRenderer

    render = PromptRenderer(tokenizer, d.chat_template, d.system_prompt)
    eval_store = RowStore(d.eval_path, "data.eval_path") if d.eval_path else None
    return DatasetSource(RowStore(d.path), render, d.prompt_key, d.answer_key,
                         d.max_prompt_tokens or default_max_prompt_tokens, d.on_bad_row, d.seed, d.shuffle,
                         eval_store, d.eval_size)


def check_data(d) -> dict[str, RowStore]:
    """Before any process starts: files exist and are not empty, the keys exist, and (``on_bad_row: error``)
    every row has a usable prompt and answer. Raises FileNotFoundError / DataError naming what is wrong.
    Returns the stores it read, by key (``data.path``, ``data.eval_path``), for ``check_run_data``."""
    from megarl.data.chat import as_messages, load_template

    if d.on_bad_row not in ("skip", "error"):
        raise DataError(f"data.on_bad_row must be 'skip' or 'error', got {d.on_bad_row!r}")
    if d.chat_template not in ("auto", "none"):
        load_template(None, d.chat_template)
    if not d.path:
        if d.eval_path:
            raise DataError("data.eval_path needs data.path (the built-in task has its own held-out set)")
        return {}
    stores = {}
    for spec, key in ((d.path, "data.path"), (d.eval_path, "data.eval_path")):
        if not spec:
            continue
        store = stores[key] = RowStore(spec, key)
        check_keys(store, d.prompt_key, d.answer_key, key)
        if d.on_bad_row == "error":
            check_rows(store, d.prompt_key, d.answer_key, lambda p: as_messages(p, d.system_prompt))
    if d.eval_path:
        check_held_out(stores["data.path"], stores["data.eval_path"])
    return stores


def check_held_out(train: RowStore, held_out: RowStore) -> None:
    """DataError when ``data.path`` (a directory or glob) takes in a file of ``data.eval_path``: the held-out
    prompts would be trained on and pass@1 measured on them. The same single file for both is taken as meant
    (a smoke test), and said."""
    train_files, held_files = ({p.path.resolve() for p in s.parts} for s in (train, held_out))
    shared = sorted(train_files & held_files)
    if not shared:
        return
    if len(train_files) == 1 and train_files == held_files:
        log.warning("data.path and data.eval_path are the same file (%s): the held-out prompts are trained on",
                    shared[0])
        return
    raise DataError(f"data.path={train.spec!r} takes in the held-out file(s) of data.eval_path={held_out.spec!r}: "
                    f"{', '.join(map(str, shared))}; the run would train on its evaluation prompts. Point data.path at "
                    "the training files only (a file, or a glob such as DIR/train*.jsonl)")


SAMPLE_ROWS = 256
"""Rows ``check_usable`` reads before launch (spread evenly over a larger dataset); the run counts the rest."""


def check_usable(store: RowStore, key: str, prompt_key: str, answer_key: str, render: Callable,
                 max_prompt_tokens: int = 0) -> dict:
    """At least one of ``SAMPLE_ROWS`` rows (all rows of a smaller dataset) parses, renders and fits
    ``max_prompt_tokens``; else DataError naming the file, the key, how many rows were read and why they were
    refused. Returns the first usable row's extra columns (what the reward function will be given)."""
    n = len(store)
    rows = range(n) if n <= SAMPLE_ROWS else np.linspace(0, n - 1, SAMPLE_ROWS).round().astype(int).tolist()
    bad, long_, first_bad, shortest = 0, 0, "", None
    for i in rows:
        where, row = store.row(int(i))
        try:
            prompt, _, extras = parse_row(row, where, prompt_key, answer_key)
            _, ids = render(prompt)
        except (DataError, PromptError) as exc:
            bad += 1
            first_bad = first_bad or (str(exc) if isinstance(exc, DataError) else f"{where}: field {prompt_key!r} {exc}")
            continue
        if max_prompt_tokens and ids is not None and len(ids) > max_prompt_tokens:
            long_ += 1
            shortest = len(ids) if shortest is None else min(shortest, len(ids))
            continue
        return extras
    read = f"all {n} rows" if n <= SAMPLE_ROWS else f"{len(rows)} rows spread over its {n}"
    why = []
    if bad:
        why.append(f"{bad} bad (first: {first_bad})")
    if long_:
        why.append(f"{long_} longer than data.max_prompt_tokens={max_prompt_tokens} tokens (the shortest has "
                   f"{shortest}; raise data.max_prompt_tokens, or engine.max_model_len - rollout.max_new_tokens when "
                   "it is 0)")
    raise DataError(f"{key}={store.spec!r}: no usable row: read {read}, refused every one: {'; '.join(why)} "
                    f"(data.prompt_key={prompt_key!r}, data.answer_key={answer_key!r})")


def _length_renderer(cfg) -> Callable:
    """``render(prompt) -> (text, ids)`` with the model's own tokenizer when it is on disk (the run's rendering, so
    the length check is exact); without one (``model.make_tiny`` not made yet) the messages only, ids None."""
    from pathlib import Path

    from megarl.data.chat import PromptRenderer, as_messages

    d = cfg.data
    model = Path(cfg.model.path)
    if (model / "tokenizer_config.json").is_file() or (model / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        return PromptRenderer(AutoTokenizer.from_pretrained(str(model)), d.chat_template, d.system_prompt)
    return lambda p: (as_messages(p, d.system_prompt), None)


def check_run_data(cfg, stores: dict[str, RowStore] | None = None) -> None:
    """Before launch, after ``check_data`` (``stores``: the ones it read, not read again): the dataset (and eval
    set) has a usable row in a bounded sample (``check_usable``, with the run's prompt-length limit), and
    ``reward.fn`` accepts the keyword arguments the run will pass it (the first usable row's other columns).
    Raises DataError / ValueError naming the key."""
    from megarl.rewards.base import check_reward_call

    d, extras = cfg.data, {}
    if d.path:
        render = _length_renderer(cfg)
        limit = d.max_prompt_tokens or (cfg.engine.max_model_len - cfg.rollout.max_new_tokens)
        for spec, key in ((d.eval_path, "data.eval_path"), (d.path, "data.path")):
            if spec:
                store = stores[key] if stores and key in stores else RowStore(spec, key)
                extras = check_usable(store, key, d.prompt_key, d.answer_key, render, limit)
    check_reward_call(cfg.reward.fn, extras)
