"""Write tiny stand-ins of the math datasets the DAPO recipes read, in their published layouts, with pyarrow.

- ``dapo-math-17k.parquet``: BytedTsinghua-SIA/DAPO-Math-17k's columns as that dataset has them: ``data_source``
  ('math_dapo'), ``prompt`` ([{content, role}]: the problem inside DAPO's "Answer: $Answer" instruction),
  ``ability`` ('MATH'), ``reward_model`` {ground_truth (an integer, as text), style ('rule-lang')},
  ``extra_info`` {index (a UUID string)};
- ``aime-2024.parquet``: the held-out set in the same layout (the DAPO release's AIME-2024 file);
- ``verl-math/train.parquet``, ``verl-math/test.parquet``: the layout verl's ``examples/data_preprocess``
  scripts write (here its MATH one): ``data_source``, ``prompt`` [{role, content}] asking for ``\\boxed{}``,
  ``ability`` ('math'), ``reward_model`` {style ('rule'), ground_truth (LaTeX: fractions, sets, radicals)},
  ``extra_info`` {split, index}.

Every answer is one math-verify checks (``reward.fn: math``). Deterministic for a seed; the problems are easy
arithmetic, not the datasets' own (configs/qwen3-30b-a3b-dapo.yaml's comments say where to get those).

    .venv/bin/python examples/math/make_stand_in.py --out runs/math_stand_in
"""

from __future__ import annotations

import argparse
import random
import uuid
from fractions import Fraction
from pathlib import Path

# DAPO-Math-17k's instruction around each problem (the model answers on a last line "Answer: ...")
DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
               "Remember to put your answer on its own line after \"Answer:\".")
# verl's MATH preprocessing: the question, then this
VERL_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def integer_problem(rng: random.Random) -> tuple[str, str]:
    """(problem, integer answer) as DAPO-Math-17k's: every answer there is an integer."""
    kind = rng.randrange(3)
    if kind == 0:
        a, b, m = rng.randint(2, 9), rng.randint(5, 40), rng.randint(7, 50)
        return f"Find the remainder when ${a}^{{{b}}}$ is divided by ${m}$.", str(pow(a, b, m))
    if kind == 1:
        n = rng.randint(12, 400)
        return f"How many positive divisors does ${n}$ have?", str(sum(n % d == 0 for d in range(1, n + 1)))
    large = rng.randint(20, 90)
    small = rng.randint(1, large - 1)
    problem = f"Two numbers have sum ${large + small}$ and difference ${large - small}$. What is the larger one?"
    return problem, str(large)


def latex(q: Fraction) -> str:
    return str(q.numerator) if q.denominator == 1 else f"\\frac{{{q.numerator}}}{{{q.denominator}}}"


def latex_problem(rng: random.Random) -> tuple[str, str]:
    """(problem, LaTeX answer) as MATH's: fractions, solution sets, simplified radicals."""
    kind = rng.randrange(3)
    if kind == 0:
        a, b = Fraction(rng.randint(1, 5), rng.randint(2, 7)), Fraction(rng.randint(1, 5), rng.randint(2, 7))
        return f"Compute ${latex(a)} + {latex(b)}$. Express your answer as a common fraction.", latex(a + b)
    if kind == 1:
        n = rng.randint(2, 9)
        return f"Find all real $x$ such that $x^2 = {n * n}$.", f"\\{{-{n}, {n}\\}}"
    n, k = rng.randint(2, 6), rng.choice([2, 3, 5, 7])
    return f"Simplify $\\sqrt{{{n * n * k}}}$.", f"{n}\\sqrt{{{k}}}"


def dapo_rows(n: int, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(n):
        problem, answer = integer_problem(rng)
        rows.append({"data_source": "math_dapo",
                     "prompt": [{"content": DAPO_PROMPT.format(problem=problem), "role": "user"}],
                     "ability": "MATH",
                     "reward_model": {"ground_truth": answer, "style": "rule-lang"},
                     "extra_info": {"index": str(uuid.UUID(int=rng.getrandbits(128), version=4))}})
    return rows


def verl_rows(n: int, split: str, rng: random.Random) -> list[dict]:
    rows = []
    for i in range(n):
        problem, answer = latex_problem(rng)
        rows.append({"data_source": "DigitalLearningGmbH/MATH-lighteval",
                     "prompt": [{"role": "user", "content": f"{problem} {VERL_INSTRUCTION}"}],
                     "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": answer},
                     "extra_info": {"split": split, "index": i}})
    return rows


def write(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/math_stand_in", help="output directory")
    parser.add_argument("--train", type=int, default=64, help="training rows of each layout")
    parser.add_argument("--test", type=int, default=16, help="held-out rows of each layout")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out, rng = Path(args.out), random.Random(args.seed)
    write(dapo_rows(args.train, rng), out / "dapo-math-17k.parquet")
    write(dapo_rows(args.test, rng), out / "aime-2024.parquet")
    write(verl_rows(args.train, "train", rng), out / "verl-math" / "train.parquet")
    write(verl_rows(args.test, "test", rng), out / "verl-math" / "test.parquet")
    print(f"wrote {args.train} training and {args.test} held-out rows of each layout to {out}: "
          "dapo-math-17k.parquet, aime-2024.parquet, verl-math/train.parquet, verl-math/test.parquet")


if __name__ == "__main__":
    main()
