"""Write a small synthetic math dataset in the layout verl's and TRL's parquet files use.

Each row has ``prompt`` (a list of chat messages), ``answer`` (LaTeX: fractions, sets,
integers) and ``level`` (an extra column; it reaches a user reward as a keyword
argument). A few malformed rows are mixed in on purpose (a line that is not JSON, a
row without an answer, a prompt that is not text), so ``data.on_bad_row`` has
something to do. Deterministic for a seed.

    .venv/bin/python examples/math/make_dataset.py --out runs/math_data
    # → train.jsonl, train.parquet, test.jsonl (held out), in --out
"""

from __future__ import annotations

import argparse
import json
import random
from fractions import Fraction
from pathlib import Path

INSTRUCTION = "Put the final answer in \\boxed{}."


def latex(q: Fraction) -> str:
    return str(q.numerator) if q.denominator == 1 else f"\\frac{{{q.numerator}}}{{{q.denominator}}}"


def problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, LaTeX answer, level) of one of three kinds."""
    kind = rng.randrange(3)
    if kind == 0:  # sum of two fractions
        a, b = Fraction(rng.randint(1, 5), rng.randint(2, 6)), Fraction(rng.randint(1, 5), rng.randint(2, 6))
        return f"Compute ${latex(a)} + {latex(b)}$ in lowest terms.", latex(a + b), 2
    if kind == 1:  # a product of small integers
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"What is {a} times {b}?", str(a * b), 1
    n = rng.randint(1, 9)  # a solution set
    return f"Find all real $x$ with $x^2 = {n * n}$.", f"\\{{-{n}, {n}\\}}", 3


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        q, a, level = problem(rng)
        out.append({"prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}], "answer": a, "level": level})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/math_data", help="output directory")
    parser.add_argument("--train", type=int, default=512, help="training rows")
    parser.add_argument("--test", type=int, default=64, help="held-out rows")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, test = rows(args.train, args.seed), rows(args.test, args.seed + 1)
    bad = [{"prompt": [{"role": "user", "content": "A row without an answer."}], "level": 1},
           {"prompt": 42, "answer": "1", "level": 1}]
    with open(out / "train.jsonl", "w") as f:
        for i, row in enumerate(train):
            f.write(json.dumps(row) + "\n")
            if i % 200 == 100:
                f.write('{"prompt": [{"role": "user", "content": "truncated\n')  # not JSON
                f.write(json.dumps(bad[(i // 200) % 2]) + "\n")
    with open(out / "test.jsonl", "w") as f:
        for row in test:
            f.write(json.dumps(row) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(train + [{"prompt": [{"role": "user", "content": "no answer"}],
                                                  "answer": None, "level": 1}]), out / "train.parquet")
    print(f"wrote {len(train)} training rows (+ malformed ones) and {len(test)} held-out rows to {out}")


if __name__ == "__main__":
    main()
