"""Environments for SmolLM2-135M-Instruct's multi-turn runs (``examples/smollm2/multiturn.yaml``, ``toolcall.yaml``).

``Feedback``: a retry-with-feedback episode on the word problems of ``make_dataset.py``. The model answers; a wrong
final number (judged by the run's reward, the built-in ``math``: math-verify) is answered with a user message, and
the model tries again, up to ``env.max_turns``; a right one ends the episode::

    user:       Tom has 14 cards and gives away 2. How many cards does Tom have left? Answer with just the number.
    assistant:  16
    user:       That is not right. Try again. Answer with just the number.
    assistant:  12                                   (right: the episode ends, reward 1 on this last turn)

``add`` and ``subtract``: the tools of ``toolcall.yaml`` (the built-in ``env.fn: tools``), which measures whether the
model calls a tool in the Hermes ``<tool_call>`` format when its prompt describes one.
"""

from __future__ import annotations

from megarl.rewards.builtin import math_reward

FEEDBACK = "That is not right. Try again. Answer with just the number."


class Feedback:
    """Answers a wrong final number with ``FEEDBACK`` (a user turn); a right one ends the episode."""

    def __init__(self, target: str, **row_extras) -> None:
        """``target``: the row's answer (``make_dataset.py`` repeats it in that column: an environment gets a row's
        other columns, not its answer)."""
        self.target = target

    def step(self, response: str) -> dict | None:
        if math_reward(response, self.target) >= 1.0:
            return None
        return {"role": "user", "content": FEEDBACK}


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first number
        b: the number added to it
    """
    return a + b


def subtract(a: int, b: int) -> int:
    """Subtract one whole number from another.

    Args:
        a: the number to subtract from
        b: the number taken away
    """
    return a - b
