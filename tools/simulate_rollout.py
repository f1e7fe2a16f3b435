#!/usr/bin/env python
"""Simulate K engines × S slots under sync, on-policy and partial rollout, with the real controller.

    python tools/simulate_rollout.py --workload sortedrl-paper
    python tools/simulate_rollout.py --workload lognormal --engines 64 --mode partial
    python tools/simulate_rollout.py --lengths trace.txt --group-size 8 --engines 2 --slots 32 \\
        --prompts-per-step 8 --max-tokens 4096 --step-time-model constant --mode sync

Prints one JSON object per mode, one per line: mode (and for on-policy its starvation
guard: long_rounds or drain), bubble_ratio, tokens_per_s, useful_tokens_per_s,
wasted_token_fraction, eta_gen, groups_per_step_mean/max (the update batch),
phase_s_mean/max, wait_phases_max (starvation), steps, samples_trained, …
``--mode all`` runs sync, on-policy with each guard, and partial. On-policy lines also carry
``bubble_floor``: the least bubble any on-policy schedule could have that trains the same
at-cap samples and generates the same tokens with no phase longer than the sync run's
longest (``on_policy_bubble_floor``; 0 under the constant step model).

``--overlap none|one_step|async|all`` models the trainer and the weight sync too (``overlap_timeline``): one
more line per mode and overlap with wall_s, samples_per_s, speedup_vs_sync (against sync rollout without overlap),
engine_utilisation, trainer_utilisation and where the engines' idle time goes (``engine_idle_*``); each
overlapped line is a run of its own whose engines sample with the weights the timeline gives them, so the
staleness overlap adds counts against ``--staleness-limit`` (wasted_token_fraction, staleness_mean). Training
costs ``--train-s-per-token`` per trained token (default: what makes training ``--train-share`` of a sync step,
0.25) and each sync ``--sync-s`` (default: 1% of the mean sync step).

    python tools/simulate_rollout.py --workload sortedrl-paper --overlap all

``--plan PLAN.json`` takes a named layout's costs from ``megarl plan --json`` (``--proposal N``: its N-th ranked
layout; 0 or a plan of a given layout: the layout shown): engines = its replicas, slots = the batch each holds,
the batch step model's seconds per decode step and per active sequence, training's seconds per generated token
(its step's training over its responses' tokens) and the sync's seconds. The workload (``--workload`` or
``--lengths``) still gives the lengths; a flag given beside ``--plan`` wins over it.

    .venv/bin/megarl plan --model examples/models/qwen3-30b-a3b.json --nodes 2 --json > plan.json
    python tools/simulate_rollout.py --workload lognormal --plan plan.json --proposal 1 --mode sync --overlap none
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megarl.rollout.sim.engines import StepTimeModel
from megarl.rollout.sim.simulator import (
    SimSettings,
    TrainerModel,
    lognormal_workload,
    on_policy_bubble_floor,
    paper_workload,
    simulate,
    with_trainer,
)


def read_lengths(path: str) -> list[int]:
    lengths = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                value = int(line)
            except ValueError:
                raise SystemExit(f"{path}:{n}: expected one integer length per line, got {line!r}") from None
            if value < 1:
                raise SystemExit(f"{path}:{n}: lengths must be >= 1, got {value}")
            lengths.append(value)
    if not lengths:
        raise SystemExit(f"{path}: no lengths")
    return lengths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", help="file with one generation length per line; runs of G lines form a group")
    src.add_argument("--workload", choices=["sortedrl-paper", "lognormal"],
                     help="built-in workload: sortedrl-paper (512 prompts, 16K cap, 8 × 64 slots, 64 per step) or "
                          "lognormal (4096 prompts, median 1000, σ 1, 8K cap, 8 × 256 slots, 512 per step, 4 steps)")
    p.add_argument("--group-size", type=int)
    p.add_argument("--engines", type=int)
    p.add_argument("--slots", type=int, help="concurrent sequences per engine")
    p.add_argument("--prompts-per-step", type=int, help="prompts per update step (default: the whole trace)")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--step-time-model", choices=["constant", "batch"])
    p.add_argument("--mode", choices=["sync", "on_policy", "partial", "all"], default="all")
    p.add_argument("--steps", type=int, help="update steps per mode (default: one pass over the trace)")
    p.add_argument("--oversubscription", type=float, help="live groups per update group (non-sync modes)")
    p.add_argument("--staleness-limit", type=int,
                   help="versions a partial-mode sample may lag (default 2; the paper workload 4; megarl train's "
                        "rollout.staleness_limit defaults to 1)")
    p.add_argument("--dispatch", choices=["pull", "lpt"])
    p.add_argument("--guard", choices=["long_rounds", "drain", "both"], default="both",
                   help="on-policy starvation guard (with --mode all or on_policy)")
    p.add_argument("--max-discards", type=int)
    p.add_argument("--long-round-groups", type=int,
                   help="on-policy long rounds: long-queue prompts per round, topped up with new ones "
                        "(default: prompts per step)")
    p.add_argument("--max-update-groups", type=int, help="the update-batch bound (default: prompts per step)")
    p.add_argument("--buffer-samples", type=int, help="admission budget in unfinished samples (default: none)")
    p.add_argument("--prompts", type=int, help="prompts in a built-in workload's trace (default: 512 or 4096)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overlap", choices=["none", "one_step", "async", "all"],
                   help="model the trainer and the sync under rollout.overlap (default: generation only)")
    p.add_argument("--train-s-per-token", type=float, help="trainer seconds per trained token (with --overlap)")
    p.add_argument("--train-share", type=float, default=0.25,
                   help="without --train-s-per-token: training's share of a sync step (default 0.25)")
    p.add_argument("--sync-s", type=float, help="seconds per weight sync (default: 1%% of the mean sync step)")
    p.add_argument("--plan", help="megarl plan --json output: take a layout's engines, slots and costs from it")
    p.add_argument("--proposal", type=int, default=1,
                   help="with --plan: the ranked layout to take (1: the fastest; 0: the layout shown)")
    args = p.parse_args(argv)
    costs = plan_costs(args.plan, args.proposal) if args.plan else {}
    if not 0 < args.train_share < 1:
        raise SystemExit(f"--train-share must be in (0, 1), got {args.train_share}")
    for name in ("train_s_per_token", "sync_s"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")

    s = SimSettings()
    if args.workload == "sortedrl-paper":
        s = SimSettings(group_size=8, engines=8, slots=64, prompts_per_step=64, max_tokens=16384, steps=16,
                        staleness_limit=4)
        lengths = paper_workload(args.seed, args.prompts or 512, s.group_size, s.max_tokens)
    elif args.workload == "lognormal":
        s = SimSettings(group_size=8, engines=8, slots=256, prompts_per_step=512, max_tokens=8192, steps=4)
        lengths = lognormal_workload(args.seed, args.prompts or 4096, s.group_size, s.max_tokens)
    else:
        lengths = read_lengths(args.lengths)
    for name, value in costs.get("settings", {}).items():
        setattr(s, name, value)
    for name, value in costs.get("trainer", {}).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("group_size", "engines", "slots", "prompts_per_step", "max_tokens", "step_time_model", "steps",
                 "oversubscription", "staleness_limit", "dispatch", "max_discards", "max_update_groups",
                 "buffer_samples", "long_round_groups"):
        value = getattr(args, name)
        if value is not None:
            setattr(s, name, value)
    for name in ("group_size", "engines", "slots", "max_tokens"):
        if getattr(s, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(s, name)}")
    if len(lengths) % s.group_size:
        raise SystemExit(f"trace has {len(lengths)} lengths, not a multiple of --group-size {s.group_size}")
    for name in ("max_update_groups", "buffer_samples", "long_round_groups"):
        if getattr(s, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 0, got {getattr(s, name)}")
    if s.max_update_groups and s.max_update_groups < (s.prompts_per_step or 1):
        raise SystemExit(f"--max-update-groups must be >= --prompts-per-step ({s.prompts_per_step})")
    guards = {"long_rounds": [True], "drain": [False], "both": [True, False]}[args.guard]
    runs = [("sync", False)] + [("on_policy", g) for g in guards] + [("partial", False)]
    sync_phase_s, baseline = None, None
    overlaps = ["none", "one_step", "async"] if args.overlap == "all" else [args.overlap] if args.overlap else []
    for mode, long_rounds in runs:
        if args.mode in ("all", mode) or (mode == "sync" and (args.mode == "on_policy" or overlaps)):
            s.long_rounds = long_rounds
            out = simulate(lengths, mode, s)
            if mode == "sync":
                sync_phase_s = out["phase_s_max"]
            elif mode == "on_policy":
                out["bubble_floor"] = on_policy_bubble_floor(out["at_cap_samples_trained"], out["tokens_generated"],
                                                             sync_phase_s, s.max_tokens, s.slots,
                                                             StepTimeModel(s.step_time_model, s.step_base_s,
                                                                           s.step_per_seq_s))
            if args.mode in ("all", mode):
                print(json.dumps({k: v for k, v in out.items() if k not in BULKY}), flush=True)
            if mode == "sync" and overlaps:
                baseline = trainer_costs(out, args)
            for overlap in overlaps if args.mode in ("all", mode) else []:
                # none samples every phase with the newest weights, as the run above; overlap adds staleness
                run = out if overlap == "none" else simulate(lengths, mode, s, TrainerModel(overlap, *baseline[:2]))
                line = with_trainer(run, overlap, baseline[0], baseline[1], s.staleness_limit)
                line["speedup_vs_sync"] = line["samples_per_s"] / baseline[2]
                print(json.dumps(line), flush=True)
    return 0


def plan_costs(path: str, proposal: int) -> dict:
    """The simulator's settings from ``megarl plan --json``'s layout number ``proposal`` (0: the layout shown):
    {'settings': SimSettings fields, 'trainer': the --train-s-per-token and --sync-s it gives}."""
    try:
        res = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"--plan {path}: not a megarl plan --json output ({exc})") from None
    if not isinstance(res, dict) or not res.get("step_time"):
        raise SystemExit(f"--plan {path}: no step time in it (a megarl plan --json of GPUs; --cpu plans have none)")
    ranked = res.get("proposals") or []
    if not 0 <= proposal <= len(ranked):
        raise SystemExit(f"--proposal {proposal}: {path} ranks {len(ranked)} layouts; valid: 0 .. {len(ranked)}")
    st = ranked[proposal - 1]["step_time"] if proposal else res["step_time"]
    r = st["rollout"]
    return {"settings": {"engines": r["replicas"], "slots": r["batch"], "step_time_model": "batch",
                         "step_base_s": r["step_base_s"], "step_per_seq_s": r["step_per_seq_s"]},
            # the simulator trains the tokens it generated: the plan's training over its responses' tokens
            "trainer": {"train_s_per_token": st["train_s"] / (st["work"]["sequences"] * st["work"]["response_tokens"]),
                        "sync_s": st["sync_s"]}}


BULKY = ("phase_s_exact", "phase_trained_tokens", "slot_s_busy", "slot_capacity")


def trainer_costs(sync: dict, args) -> tuple[float, float, float]:
    """Train seconds per token and sync seconds (given, or from the sync run: training ``--train-share`` of a step,
    a sync 1% of one), and the sync run's samples per second with them (the baseline of ``speedup_vs_sync``)."""
    gen, tokens = sum(sync["phase_s_exact"]), sum(sync["phase_trained_tokens"])
    per_token = args.train_s_per_token
    if per_token is None:
        per_token = args.train_share / (1 - args.train_share) * gen / tokens
    steps = len(sync["phase_s_exact"])
    sync_s = args.sync_s if args.sync_s is not None else 0.01 * (gen + per_token * tokens) / steps
    return per_token, sync_s, with_trainer(sync, "none", per_token, sync_s, 0)["samples_per_s"]


if __name__ == "__main__":
    sys.exit(main())
