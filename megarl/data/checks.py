"""What is checked of a dataset before any process starts, and what the run itself checks when it opens one:
files and keys exist, bad rows (``on_bad_row: error``), the held-out files are not trained on, a usable row
within the prompt-length limit, and that ``reward.fn`` takes the row's columns."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from megarl.data.chat import PromptRenderer, as_messages, load_template
from megarl.data.readers import RowStore
from megarl.data.rows import DataError, Keys, keys_of, parse_and_render

log = logging.getLogger(__name__)


def check_keys(store: RowStore, keys: Keys, key: str = "data.path") -> None:
    for name, k in ((keys.prompt_name, keys.prompt), (keys.answer_name, keys.answer)):
        if not store.has_key(k):
            fix, note = name, ""
            if key == "data.eval_path" and not name.startswith("data.eval_"):  # the training set's key: keep it
                fix = f"data.eval_{name.removeprefix('data.')}"
                note = f" (the held-out set's own; {name} stays data.path's)"
            raise DataError(f"{key}={store.spec!r}: no row has the key {k!r} ({name}); set {fix} to the column "
                            f"that holds it{note} (a dotted key reads a nested field); the rows have: "
                            f"{', '.join(store.column_names()) or 'no columns'}")


SHOWN_BAD_ROWS = 10
"""Bad rows ``check_rows`` names in its error (it counts them all): a file's problems are fixed in one round."""


def check_rows(store: RowStore, keys: Keys, render: Callable | None = None) -> None:
    """Every row parses (and renders, given ``render``); else DataError naming the first ``SHOWN_BAD_ROWS`` bad
    rows and counting them all."""
    bad: list[str] = []
    count = 0
    for i in range(len(store)):
        where, row = store.row(i)
        try:
            parse_and_render(row, where, keys, render or (lambda prompt: None))
        except DataError as exc:
            problem = str(exc)
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


def check_data(d, training: bool = True) -> dict[str, RowStore]:
    """Before any process starts: files exist and are not empty, the keys exist, and (``on_bad_row: error``)
    every row has a usable prompt and answer; ``training``: ``data.path`` does not take in the held-out files
    (``megarl eval`` trains nothing). Raises FileNotFoundError / DataError naming what is wrong.
    Returns the stores it read, by key (``data.path``, ``data.eval_path``), for ``check_run_data``."""
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
        store, keys = RowStore(spec, key), keys_of(d, key)
        stores[key] = store
        check_keys(store, keys, key)
        if d.on_bad_row == "error":
            check_rows(store, keys, lambda p: as_messages(p, d.system_prompt))
    if d.eval_path and training:
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


def check_usable(store: RowStore, key: str, keys: Keys, render: Callable,
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
            _, extras, (_, ids) = parse_and_render(row, where, keys, render)
        except DataError as exc:
            bad += 1
            first_bad = first_bad or str(exc)
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
                    f"({keys.prompt_name}={keys.prompt!r}, {keys.answer_name}={keys.answer!r})")


def _length_renderer(cfg, tools: list | None = None, model_files: Path | None = None) -> Callable:
    """``render(prompt) -> (text, ids)`` with the model's own tokenizer when it is on disk (the run's rendering, so
    the length check is exact); without one (``model.make_tiny`` not made yet) the messages only, ids None."""
    d = cfg.data
    model = model_files or Path(cfg.model.path)
    if (model / "tokenizer_config.json").is_file() or (model / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        return PromptRenderer(AutoTokenizer.from_pretrained(str(model)), d.chat_template, d.system_prompt, tools,
                              d.enable_thinking)
    return lambda p: (as_messages(p, d.system_prompt), None)


def check_run_data(cfg, stores: dict[str, RowStore] | None = None, tools: list | None = None,
                   model_files: Path | None = None) -> dict[str, dict]:
    """Before launch, after ``check_data`` (``stores``: the ones it read, not read again): the dataset (and eval
    set) has a usable row in a bounded sample (``check_usable``, with the run's prompt-length limit; ``tools``: the
    functions the prompts describe). Returns, by key (``data.eval_path``, ``data.path``), the other columns of the
    first usable row: the keyword arguments the reward function will get. Raises DataError naming the key."""
    d = cfg.data
    if not d.path:
        return {}
    render = _length_renderer(cfg, tools, model_files)
    limit = d.max_prompt_tokens or (cfg.engine.max_model_len - cfg.rollout.max_new_tokens)
    extras = {}
    for spec, key in ((d.eval_path, "data.eval_path"), (d.path, "data.path")):
        if spec:  # (each set's columns: a held-out set in another layout hands the reward other ones)
            store = stores[key] if stores and key in stores else RowStore(spec, key)
            extras[key] = check_usable(store, key, keys_of(d, key), render, limit)
    return extras
