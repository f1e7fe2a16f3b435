"""One dataset row → (prompt, answer, other columns), and where a dataset keeps them (``Keys``).

A key is a column or a dotted path into nested (struct) fields (verl's ``reward_model.ground_truth``).
The held-out set may keep its prompt and answer under other names than the training set
(``data.eval_prompt_key``, ``data.eval_answer_key``): every message names the key that was read.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

from megarl.data.chat import PromptError
from megarl.data.readers import MISSING, BadRow, get_field

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A dataset problem found before training; the message names file, line/row and field."""


class Keys(NamedTuple):
    """Where a dataset's prompt and answer are, and the config keys that said so (for messages)."""

    prompt: str = "prompt"
    answer: str = "answer"
    prompt_name: str = "data.prompt_key"
    answer_name: str = "data.answer_key"


def keys_of(d, key: str = "data.path") -> Keys:
    """The keys ``data.*`` gives the dataset at ``key`` (``data.path`` or ``data.eval_path``): the held-out set's own
    ``eval_prompt_key`` / ``eval_answer_key`` where set, else the training set's."""
    if key != "data.eval_path":
        return Keys(d.prompt_key, d.answer_key)
    return Keys(d.eval_prompt_key or d.prompt_key, d.eval_answer_key or d.answer_key,
                "data.eval_prompt_key" if d.eval_prompt_key else "data.prompt_key",
                "data.eval_answer_key" if d.eval_answer_key else "data.answer_key")


def parse_row(row: dict | BadRow, where: str, keys: Keys) -> tuple[object, str, dict]:
    """``(prompt, answer, extras)`` of a row, or DataError naming where and which field is wrong.

    A key may be a column or a dotted path into nested (struct) fields, such as verl's
    ``reward_model.ground_truth``. ``answer_key`` equal to ``prompt_key`` reads a conversation (TRL's ``messages``):
    the prompt is every message before the last assistant turn and the answer is that turn's content.
    A conversation with a separate answer column loses its trailing assistant turns (``without_trailing_answer``).
    ``extras`` are the row's other top-level columns (a nested answer's column stays in them)."""
    if isinstance(row, BadRow):
        raise DataError(f"{where}: {row.why}")
    prompt_key, answer_key = keys.prompt, keys.answer
    prompt = get_field(row, prompt_key)
    if prompt is MISSING or prompt is None:
        raise DataError(f"{where}: field {prompt_key!r} ({keys.prompt_name}) is missing or null")
    if answer_key == prompt_key:
        prompt, answer = split_conversation(prompt, where, keys)
    else:
        answer = get_field(row, answer_key)
        prompt = without_trailing_answer(prompt, keys)
    if answer is MISSING or answer is None or isinstance(answer, (dict, list)):
        shown = None if answer is MISSING else answer
        hint = (f"; name one of its fields with a dotted key: {', '.join(repr(f'{answer_key}.{k}') for k in answer)}"
                if isinstance(answer, dict) and answer else "")
        raise DataError(f"{where}: field {answer_key!r} ({keys.answer_name}) must be a string or number, got "
                        f"{shown!r:.60}{hint}")
    extras = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
    return prompt, str(answer), extras


def parse_and_render(row: dict | BadRow, where: str, keys: Keys, render) -> tuple[str, dict, object]:
    """``(answer, extras, render(prompt))`` of a row; DataError for a bad field or a prompt ``render`` refuses
    (``PromptError``, named with the prompt's key): the run's sources and the checks before launch alike."""
    prompt, answer, extras = parse_row(row, where, keys)
    try:
        return answer, extras, render(prompt)
    except PromptError as exc:
        raise DataError(f"{where}: field {keys.prompt!r} {exc}") from None


def without_trailing_answer(prompt, keys: Keys):
    """A conversation that ends with assistant turns (OpenAI/TRL ``messages`` beside a separate answer column) less
    those turns: they hold the reference response, which the prompt would hand the policy. Said once per key."""
    if not isinstance(prompt, (list, tuple)):
        return prompt
    end = len(prompt)
    while end and isinstance(prompt[end - 1], dict) and prompt[end - 1].get("role") == "assistant":
        end -= 1
    if end < len(prompt):
        _say_trimmed(keys.prompt, keys.answer_name)
    return list(prompt[:end])


@functools.cache  # once per key and process
def _say_trimmed(key: str, answer_name: str) -> None:
    log.warning("data: field %r holds conversations that end with an assistant turn (the reference response): the "
                "prompt is the messages before it (set %s=%s to take that turn as the answer)", key, answer_name, key)


def split_conversation(messages, where: str, keys: Keys) -> tuple[list, str]:
    """A conversation → (the messages before its last assistant turn, that turn's content)."""
    last = -1
    if isinstance(messages, (list, tuple)):
        last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
                   default=-1)
    if last < 1:
        raise DataError(f"{where}: field {keys.prompt!r} ({keys.prompt_name} = {keys.answer_name}: "
                        "a conversation whose last assistant turn is the answer) must be a list of messages with an "
                        f"assistant turn after at least one other message, got {messages!r:.80}")
    return list(messages[:last]), messages[last].get("content")
