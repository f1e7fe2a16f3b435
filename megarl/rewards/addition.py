"""Exact-answer reward for the addition task (kept under its old name; see ``builtin.addition_reward``)."""

from __future__ import annotations

from megarl.data.addition import extract_answer


def exact_answer(response: str, answer: str, **_) -> float:
    """1.0 when the text after the last '>' equals the reference answer exactly, else 0.0."""
    return 1.0 if extract_answer(response) == answer else 0.0
