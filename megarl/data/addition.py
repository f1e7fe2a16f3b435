"""Multi-digit addition with a per-digit scratchpad: a verifiable task whose answers vary in length.

A prompt is ``"4073+958:"``; the reference response walks the digits from the right,
one step per column, each step ``x+y+carry=tt`` (two-digit column total), then the
answer after ``>``::

    4073+958:3+8+0=11,7+5+1=13,0+9+1=10,4+0+1=05>5031

Operand sizes are drawn from a heavy-tailed (power-law) distribution over
``1..max_digits`` digits, so most responses are short and a few are long: the
length spread that the SortedRL controller exploits. Response length is
``9·n + 1 + len(answer)`` characters for ``n`` columns.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Every character the task writes; the tiny tokenizer's vocabulary is built from it.
ALPHABET = "0123456789+=,>:"


@dataclass(frozen=True)
class Problem:
    """One addition problem: its prompt text, the reference response and the answer."""

    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}:"

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    @property
    def response(self) -> str:
        return scratchpad(self.a, self.b)


def scratchpad(a: int, b: int) -> str:
    """The reference response for ``a + b``: one ``x+y+c=tt`` step per column, then ``>answer``."""
    da, db = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        total = x + y + carry
        steps.append(f"{x}+{y}+{carry}={total:02d}")
        carry = total // 10
    return ",".join(steps) + ">" + str(a + b)


def extract_answer(response: str) -> str | None:
    """The text after the last ``>``, or None when the response never reached an answer."""
    if ">" not in response:
        return None
    return response.rsplit(">", 1)[1].strip()


def digit_weights(max_digits: int, tail_alpha: float) -> list[float]:
    """P(d) ∝ d^-alpha for d = 1..max_digits: a power law, heavy towards short operands."""
    return [d ** (-tail_alpha) for d in range(1, max_digits + 1)]


def sample_problem(rng: random.Random, max_digits: int, tail_alpha: float) -> Problem:
    """Draw each operand's digit count from the power law, then its digits uniformly."""
    weights = digit_weights(max_digits, tail_alpha)
    sizes = rng.choices(range(1, max_digits + 1), weights=weights, k=2)
    a, b = (rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1) for d in sizes)
    return Problem(a, b)


class AdditionTask:
    """An endless, seeded stream of training problems and a fixed held-out evaluation set.

    The evaluation problems are drawn first from their own seed; the training
    stream skips any problem that is in the evaluation set, so pass@1 is measured
    on prompts RL never trained on. ``cursor`` counts problems drawn, so a
    checkpoint can resume the stream exactly (``skip_to``).
    """

    def __init__(self, max_digits: int, tail_alpha: float, seed: int, eval_size: int) -> None:
        if max_digits < 1:
            raise ValueError(f"data.max_digits must be >= 1, got {max_digits}")
        self.max_digits = max_digits
        self.tail_alpha = tail_alpha
        self.seed = seed
        eval_rng = random.Random(seed * 7919 + 1)
        self.eval_problems: list[Problem] = []
        seen: set[Problem] = set()
        attempts = 0
        while len(self.eval_problems) < eval_size and attempts < 100 * eval_size:
            attempts += 1
            p = sample_problem(eval_rng, max_digits, tail_alpha)
            if p not in seen:
                seen.add(p)
                self.eval_problems.append(p)
        self._eval_set = seen
        self._rng = random.Random(seed)
        self.cursor = 0

    def next_problem(self) -> Problem:
        while True:
            p = sample_problem(self._rng, self.max_digits, self.tail_alpha)
            self.cursor += 1
            if p not in self._eval_set:
                return p

    def next_problems(self, n: int) -> list[Problem]:
        return [self.next_problem() for _ in range(n)]

    def skip_to(self, cursor: int) -> None:
        """Replay the stream from its seed up to ``cursor`` draws (checkpoint resume)."""
        self._rng = random.Random(self.seed)
        self.cursor = 0
        while self.cursor < cursor:
            sample_problem(self._rng, self.max_digits, self.tail_alpha)
            self.cursor += 1
