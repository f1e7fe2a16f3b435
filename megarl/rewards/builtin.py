"""Built-in verifiers: ``math`` (math-verify), ``exact`` and ``addition``, with their format checks.

Each is ``fn(response, answer, **row_extras) -> float``; extra columns of the row are
accepted and ignored. ``FORMAT`` holds, per built-in, the check behind
``reward.format_coef``: does the response end in a well-formed final answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from megarl.data.addition import extract_answer

_BOXED = re.compile(r"\\boxed\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def math_reward(response: str, answer: str, **_) -> float:
    """1.0 when math-verify finds the response's final answer equal to the reference.

    The final answer is the last ``\\boxed{}`` when there is one, else what math-verify extracts
    from the whole response.

    Equivalence is symbolic: ``\\frac{1}{2}`` = ``0.5`` = ``1/2``; sets and intervals compare as
    such; LaTeX and plain expressions mix. The reference is read as the content of a ``\\boxed{}``
    unless it already carries its own ``$...$`` or ``\\boxed``.
    """
    from math_verify import parse, verify

    ref = str(answer)
    gold = parse(ref if ("$" in ref or "\\boxed" in ref) else "\\boxed{" + ref + "}")
    boxed = last_boxed(response)
    pred = parse(response if boxed is None else "\\boxed{" + boxed + "}")
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred) else 0.0


def exact_reward(response: str, answer: str, **_) -> float:
    """1.0 when the final answer (the last ``\\boxed{}``, else the whole stripped response) equals the reference."""
    final = last_boxed(response)
    final = response if final is None else final
    return 1.0 if final.strip() == str(answer).strip() else 0.0


def addition_reward(response: str, answer: str, **_) -> float:
    """The addition task's reward: 1.0 when the text after the last '>' equals the reference exactly."""
    return 1.0 if extract_answer(response) == str(answer) else 0.0


BUILTINS: dict[str, Callable[..., float]] = {
    "math": math_reward,
    "exact": exact_reward,
    "addition": addition_reward,
}

FORMAT: dict[str, Callable[[str], bool]] = {
    "math": lambda r: last_boxed(r) is not None,
    "exact": lambda r: last_boxed(r) is not None,
    "addition": lambda r: extract_answer(r) not in (None, ""),
}
