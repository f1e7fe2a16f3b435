#!/usr/bin/env python
"""Real-engine rollout throughput: sync vs SortedRL on-policy vs partial, interleaved and repeated in one process.

vLLM's CPU build, a tiny dense model, a length-controlled workload (``ignore_eos``
with each sample's length drawn from a heavy-tailed distribution, fixed seed).
The same controller code as training drives the engine; no training happens, the
policy version just advances per phase.

Fair accounting: every mode gets the same ``phases × prompts_per_step`` prompts and
runs until each of them is trained (partial mode's buffer is drained, on-policy's
re-queued and long prompts run), so every mode trains the same samples, the update
batch per step is ``prompts_per_step`` in every mode, no tokens are left in a buffer,
and each mode pays its own tail (the last phases, when only long prompts remain) in
its time. Draining rather than discounting: a buffered sample's tokens were generated
in the same engine steps as trained ones, so their time cannot be split off honestly.

Interleaving: the three modes run one phase each in turn on the one engine (each its
own controller; the engine is empty between phases), so a spell of load from other
jobs falls on all of them; ``--repeats`` such rounds (the opening mode rotated). Rates
are per CPU second of this process's own phases (the engine runs in it with one
thread), which other load on a shared machine barely moves; per wall second is
printed too. Each ratio to sync is taken per round (paired) and the figure is the
median over rounds, with the rounds' spread. Prints one JSON line per (round, mode),
then the medians and the ratios in output tokens/s and useful tokens/s (tokens that
reach the loss), and the update batch per step.

    .venv/bin/python bench/rollout_throughput.py [--phases 16] [--repeats 5] [--slots 64]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

from megarl.engines.vllm_engine import VLLMEngine, VLLMSlotEngine, set_cpu_engine_env
from megarl.models.tiny import TinyShape, make_tiny_model
from megarl.rollout.controller import ControllerConfig, PromptItem, RolloutController
from megarl.rollout.phase_metrics import PhaseMetrics

MODES = ("sync", "on_policy", "partial")


def heavy_tailed_lengths(rng: random.Random, groups: int, group_size: int, cap: int) -> list[list[int]]:
    """Per group: 80% short (8–48 tokens), 15% long (48–cap), 5% at the cap."""
    out, short = [], min(48, cap)
    for _ in range(groups):
        u = rng.random()
        lo, hi = (min(8, short), short) if u < 0.80 else ((short, cap) if u < 0.95 else (cap, cap))
        out.append([rng.randint(lo, hi) for _ in range(group_size)])
    return out


class ModeRun:
    """One mode's controller over the shared engine, run phase by phase; its clocks count its own phases only."""

    def __init__(self, engine: VLLMEngine, mode: str, lengths: list[list[int]], args) -> None:
        self.engine, self.mode, self.prompts = engine, mode, args.phases * args.prompts_per_step
        self.max_phases = 20 * args.phases
        counter = {"i": 0}

        def next_prompt():
            i = counter["i"]
            if i >= self.prompts:
                return None
            counter["i"] += 1
            return PromptItem(i, [3 + i % 10, 4, 12, 5 + i % 7, 16], key=i % len(lengths))

        def length_of(key):
            return lengths[key[0] % len(lengths)][key[1]]

        cfg = ControllerConfig(mode=mode, group_size=args.group_size, update_groups=args.prompts_per_step,
                               rollout_groups=args.prompts_per_step * (1 if mode == "sync" else 2),
                               max_tokens=args.cap, staleness_limit=args.staleness_limit, temperature=1.0,
                               long_rounds=True)
        self.ctrl = RolloutController(cfg, [VLLMSlotEngine(engine, args.slots, length_of)], next_prompt)
        self.total, self.batches, self.version, self.wall, self.cpu = PhaseMetrics(), [], 0, 0.0, 0.0

    @property
    def done(self) -> bool:
        """Every prompt trained: nothing of this mode is left in a buffer."""
        return len(self.ctrl.released) >= self.prompts or self.version >= self.max_phases

    def phase(self) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        groups, m = self.ctrl.run_phase(self.version)
        self.wall += time.perf_counter() - t0
        self.cpu += time.process_time() - c0
        if self.engine.llm.llm_engine.has_unfinished_requests():
            raise RuntimeError(f"{self.mode}: the engine still has requests after a phase; modes would share it")
        self.total.merge(m)
        self.batches.append(len(groups))
        self.version += 1

    def result(self) -> dict:
        total, wall, cpu = self.total, self.wall, self.cpu
        out = {k.split("/", 1)[1]: v for k, v in total.summary().items()}
        if not self.done or len(self.ctrl.released) < self.prompts:
            raise RuntimeError(f"{self.mode}: {len(self.ctrl.released)} of {self.prompts} prompts trained "
                               f"in {self.version} phases")
        return {"mode": self.mode, "bubble_ratio": out["bubble_ratio"],
                "tokens_per_cpu_s": total.tokens_generated / cpu,
                "useful_tokens_per_cpu_s": total.tokens_useful / cpu, "tokens_per_s": total.tokens_generated / wall,
                "useful_tokens_per_s": total.tokens_useful / wall,
                "wasted_token_fraction": out["wasted_token_fraction"], "samples_trained": total.samples_trained,
                "phases": self.version, "seconds": wall, "cpu_seconds": cpu,
                "groups_per_step_max": max(self.batches), "groups_per_step_mean": sum(self.batches) / len(self.batches)}


def run_round(engine: VLLMEngine, modes: tuple[str, ...], lengths: list[list[int]], args) -> dict[str, dict]:
    """The modes' phases interleaved one by one (each its own controller; the engine is empty between phases)."""
    runs = [ModeRun(engine, m, lengths, args) for m in modes]
    while not all(r.done for r in runs):
        for r in runs:
            if not r.done:
                r.phase()
    return {r.mode: r.result() for r in runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", type=int, default=16, help="prompts per mode = phases × prompts per step")
    p.add_argument("--repeats", type=int, default=5, help="paired rounds; the ratios are medians over rounds")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--cap", type=int, default=256)
    p.add_argument("--staleness-limit", type=int, default=8, help="partial mode's k")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if min(args.phases, args.repeats, args.slots, args.group_size, args.prompts_per_step, args.cap) < 1:
        raise SystemExit("--phases, --repeats, --slots, --group-size, --prompts-per-step and --cap must be >= 1")
    set_cpu_engine_env(1)
    import vllm  # noqa: F401

    from megarl.distributed.parallel import init_process_group

    init_process_group()
    lengths = heavy_tailed_lengths(random.Random(args.seed), args.phases * args.prompts_per_step, args.group_size,
                                   args.cap)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(f"{tmp}/model", TinyShape(family="qwen2", max_position_embeddings=args.cap + 64))
        engine = VLLMEngine(str(model), args.cap + 32, 1.0, max_num_seqs=args.slots, seed=args.seed)
        run_round(engine, MODES, lengths, argparse.Namespace(**{**vars(args), "phases": 1}))  # first-use costs
        for r in range(args.repeats):
            order = MODES[r % 3:] + MODES[:r % 3]  # which mode opens each interleaved turn, rotated per round
            for mode, result in run_round(engine, order, lengths, args).items():
                runs[mode].append(result)
                print(json.dumps({"round": r, **result}), flush=True)
    med = {m: {k: statistics.median(x[k] for x in runs[m]) for k in runs[m][0] if k != "mode"} for m in MODES}

    def ratios(m: str, key: str) -> list[float]:
        """Per round: the mode's rate over sync's in the same round (paired, so slow spells of load cancel)."""
        return [x[key] / y[key] for x, y in zip(runs[m], runs["sync"])]

    keys = ("useful_tokens_per_cpu_s", "tokens_per_cpu_s", "useful_tokens_per_s", "tokens_per_s")
    for m in MODES:
        per_round = {k: ratios(m, k) for k in keys}
        print(json.dumps({"mode": m, "median": True, **med[m],
                          **{f"x_{k}": statistics.median(v) for k, v in per_round.items()},
                          **{f"x_{k}_per_round": [round(x, 3) for x in v] for k, v in per_round.items()}}))
    for m in MODES[1:]:
        u, o, uw = (ratios(m, k) for k in keys[:3])
        print(f"{m}: {statistics.median(u):.2f}x useful tokens/s (rounds {min(u):.2f}-{max(u):.2f}), "
              f"{statistics.median(o):.2f}x output tokens/s ({min(o):.2f}-{max(o):.2f}) vs sync per CPU second "
              f"({statistics.median(uw):.2f}x useful per wall second) (median of {args.repeats} paired rounds; "
              f"bubble {med[m]['bubble_ratio']:.1%} vs {med['sync']['bubble_ratio']:.1%}, "
              f"{med[m]['wasted_token_fraction']:.1%} wasted, {med[m]['samples_trained']:.0f} samples trained vs "
              f"{med['sync']['samples_trained']:.0f}, at most {med[m]['groups_per_step_max']:.0f} groups per step)")


if __name__ == "__main__":
    main()
