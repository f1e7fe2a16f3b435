"""Write short arithmetic word problems for GRPO on SmolLM2-135M-Instruct.

Each row has ``prompt`` (chat messages: one user turn), ``answer`` (a plain integer, as a
string), ``op`` (``+`` or ``-``: an extra column, it reaches a user reward as a keyword
argument and is ignored by the built-ins) and ``target`` (the answer again: an environment is
built from a row's other columns, not its answer, and ``feedback.py``'s tells a wrong number
from a right one). Operands are drawn from --low..--high (1..20 by default:
SmolLM2-135M-Instruct gets about 0.3 of these right greedily, 0.1 at 2..50); subtraction never
goes below zero. The held-out set (test.jsonl) shares no (template, a, op, b) problem with the
training set. Deterministic for a seed.

    .venv/bin/python examples/smollm2/make_dataset.py --out runs/smollm2_data
    # -> train.jsonl, test.jsonl in --out
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Max", "Emma", "Leo", "Zoe"]
ITEMS = ["apples", "books", "pencils", "stickers", "marbles", "cookies", "coins", "cards"]

# (template, op): {n} a name, {x} an item; {a} and {b} the operands.
TEMPLATES = [
    ("{n} has {a} {x} and gets {b} more. How many {x} does {n} have now?", "+"),
    ("{n} had {a} {x} and found {b} more. How many {x} does {n} have in total?", "+"),
    ("There are {a} {x} in a box. {n} puts in {b} more. How many {x} are in the box?", "+"),
    ("{n} has {a} {x} and gives away {b}. How many {x} does {n} have left?", "-"),
    ("{n} had {a} {x} and lost {b} of them. How many {x} are left?", "-"),
    ("There are {a} {x} in a box. {n} takes out {b}. How many {x} are in the box now?", "-"),
]

INSTRUCTIONS = {
    "boxed": "Put the final answer in \\boxed{}.",
    "number": "Answer with just the number.",
    "short": "Think briefly, then give the final answer as \\boxed{number}.",
    "none": "",
}


def problem(rng: random.Random, low: int, high: int) -> tuple[tuple, str, str]:
    """(key, question, answer) for one random problem; key identifies it for the train/test split."""
    t = rng.randrange(len(TEMPLATES))
    template, op = TEMPLATES[t]
    a, b = rng.randint(low, high), rng.randint(low, high)
    if op == "-" and b > a:
        a, b = b, a
    n, x = rng.choice(NAMES), rng.choice(ITEMS)
    ans = a + b if op == "+" else a - b
    return (t, a, op, b), template.format(n=n, x=x, a=a, b=b), str(ans)


def row(question: str, answer: str, op: str, style: str) -> dict:
    content = f"{question} {INSTRUCTIONS[style]}".strip()
    return {"prompt": [{"role": "user", "content": content}], "answer": answer, "op": op, "target": answer}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/smollm2_data", help="output directory")
    parser.add_argument("--train", type=int, default=4000, help="training rows")
    parser.add_argument("--test", type=int, default=200, help="held-out rows")
    parser.add_argument("--style", default="number", choices=sorted(INSTRUCTIONS), help="answer instruction")
    parser.add_argument("--low", type=int, default=1, help="smallest operand")
    parser.add_argument("--high", type=int, default=20, help="largest operand")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    test, seen = [], set()
    while len(test) < args.test:  # held-out problems first; training never repeats one of them
        key, q, a = problem(rng, args.low, args.high)
        if key not in seen:
            seen.add(key)
            test.append(row(q, a, key[2], args.style))
    train = []
    while len(train) < args.train:
        key, q, a = problem(rng, args.low, args.high)
        if key not in seen:
            train.append(row(q, a, key[2], args.style))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        with open(out / f"{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print(f"wrote {len(train)} train and {len(test)} test rows ({args.style}) to {out}")


if __name__ == "__main__":
    main()
