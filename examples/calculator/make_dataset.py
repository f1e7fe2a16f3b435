"""Write the calculator example's data: long multiplication, with and without a ``multiply`` tool.

A problem multiplies a 3-digit number by a 2-digit one (``What is 407 * 58?``, answer ``23606``). The
files, in ``--out``:

- ``train.jsonl``, ``test.jsonl``: RL prompts and the held-out set (``prompt``, ``answer``); no problem of one is
  in the other (nor its mirror, ``58 * 407``).
- ``warmup_tool.jsonl``: the warm-up of the tool arm, the training problems as tool-use episodes in the Hermes /
  Qwen format, ``{"messages": [user, assistant, tool, assistant]}``::

      user:       What is 407 * 58?
      assistant:  <tool_call>{"name": "multiply", "arguments": {"a": 407, "b": 58}}</tool_call>
      tool:       23606
      assistant:  23606

- ``warmup_direct.jsonl``: the warm-up of the no-tool arm, the same problems answered at once
  (``[user, assistant: 23606]``).

Deterministic for a seed.

    .venv/bin/python examples/calculator/make_dataset.py --out runs/calculator/data
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

FIRST_DIGITS, SECOND_DIGITS = (3, 3), (2, 2)
# (fixed widths: each operand's digits sit at the same offsets in every prompt and every call, a copy a tiny model
# learns within the warm-up; with 2-4 and 1-3 digits it copied too few of them, see the README)


def number(rng: random.Random, digits: tuple[int, int]) -> int:
    n = rng.randint(*digits)
    return rng.randint(10 ** (n - 1), 10**n - 1)


def problems(n_train: int, n_test: int, seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Distinct (a, b) pairs, the held-out ones first drawn and kept apart (with their mirrors)."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n_test + n_train:
        a, b = number(rng, FIRST_DIGITS), number(rng, SECOND_DIGITS)
        if (a, b) not in seen and (b, a) not in seen:
            seen.add((a, b))
            out.append((a, b))
    return out[n_test:], out[:n_test]


def prompt(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def tool_episode(a: int, b: int) -> list[dict]:
    call = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}})
    return [{"role": "user", "content": prompt(a, b)},
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)}]


def direct_episode(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": prompt(a, b)}, {"role": "assistant", "content": str(a * b)}]


def write(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/calculator/data", help="output directory")
    parser.add_argument("--train", type=int, default=4000, help="training problems (RL prompts and warm-up)")
    parser.add_argument("--test", type=int, default=200, help="held-out problems")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, test = problems(args.train, args.test, args.seed)
    write(out / "train.jsonl", [{"prompt": prompt(a, b), "answer": str(a * b)} for a, b in train])
    write(out / "test.jsonl", [{"prompt": prompt(a, b), "answer": str(a * b)} for a, b in test])
    write(out / "warmup_tool.jsonl", [{"messages": tool_episode(a, b)} for a, b in train])
    write(out / "warmup_direct.jsonl", [{"messages": direct_episode(a, b)} for a, b in train])
    print(f"wrote {len(train)} training and {len(test)} held-out problems, and both warm-ups, to {out}")


if __name__ == "__main__":
    main()
