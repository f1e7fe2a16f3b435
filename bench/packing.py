#!/usr/bin/env python
"""Trained tokens per second of the megatron-core trainer, packed against padded, side by side in one run.

One RL batch per task, the demo's shape (``rollout.prompts_per_step`` 32 × ``samples_per_prompt`` 8 rows; the demo's
tiny Qwen3-MoE in fp32, ``optim.micro_batch_size`` 64, ``optim.logprob_chunk`` 1024), at the demo's settings and on
the long tail (``data.max_digits=12 data.tail_alpha=0.5 rollout.max_new_tokens=128``). With ``--rollouts`` the
batches are real: a short ``megarl train`` of the demo per task (``--warmup`` supervised steps, then ``--rl-steps``
RL steps with the task's settings; ``rollout.mode`` the config's, sync, unless ``--mode`` names another) records the
samples of its last RL step, which the trainers then take. Without it: the task's prompts with their reference
answers (what the warm-up teaches, cut at ``rollout.max_new_tokens``; the same length for a group's 8 samples, where
a policy's vary). Three trainers from the same weights take GRPO steps on it in turn, repeat after repeat: padded
(``trainer.packing=false``: every row padded to the batch's longest), packed by rows (the default: 64 rows a
micro-batch laid end to end) and packed by tokens (``trainer.max_tokens_per_microbatch``). Trained tokens are the
rows' own (prompt + response − 1 each); the figure is the median over repeats of each trainer's step time, as tokens
per second and as a ratio to padded, and the same per CPU second of the process (``time.process_time``: less moved by
other jobs on a shared machine). The process computes as megarl places a lone trainer (``distributed/placement.py``:
every core of the host): what a user gets.

    .venv/bin/python bench/packing.py [--repeats 5] [--max-tokens 4096] [--tasks demo,long_tail]
                                      [--rollouts [--warmup 100] [--rl-steps 3] [--mode partial] [--save FILE]]
                                      [--rollouts-from FILE]

A policy's batch moves with any change to what trained it (the order of a sum is enough to sample other lengths;
its padding share is what packing can save): ``--save`` keeps the recorded batches, ``--rollouts-from`` measures
on them again, e.g. two commits on one batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

TASKS = {"demo": dict(max_digits=4, tail_alpha=1.0, max_new_tokens=80),  # configs/demo.yaml
         "long_tail": dict(max_digits=12, tail_alpha=0.5, max_new_tokens=128)}


def host() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        name = platform.processor()
    return f"{name}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}"


def task_batch(task: dict, tokenizer, rows: int, group: int, seed: int = 0):
    """``rows`` samples, ``group`` per prompt, of the addition task with its reference answers (+ EOS, cut)."""
    from megarl.algo.batch import build_batch
    from megarl.data import encode, pad_id
    from megarl.data.addition import AdditionTask

    problems = AdditionTask(task["max_digits"], task["tail_alpha"], seed=seed, eval_size=0).next_problems(rows // group)
    eos = tokenizer.eos_token_id
    prompts, responses = [], []
    for p in problems:
        for _ in range(group):
            prompts.append(encode(tokenizer, p.prompt))
            responses.append((encode(tokenizer, p.response) + [eos])[: task["max_new_tokens"]])
    g = torch.Generator().manual_seed(seed)
    adv = (torch.rand(len(prompts), generator=g) * 2 - 1).tolist()
    return build_batch(prompts, responses, [[-1.0] * len(r) for r in responses], adv, pad_id=pad_id(tokenizer))


TASK_SETTINGS = {"demo": [], "long_tail": ["data.max_digits=12", "data.tail_alpha=0.5", "rollout.max_new_tokens=128",
                                          "engine.max_model_len=160"]}


def record_rollouts(task: str, out: str, warmup: int, steps: int, mode: str | None) -> None:
    """In this process: ``megarl train`` of the demo with the task's settings, recording each RL step's samples
    (prompt and response ids, from ``rl_update.rollout_batch``) into ``out`` as JSON: ``steps``, one list per step,
    and the run's ``mode`` (``rollout.mode`` as the run resolved it)."""
    from megarl import cli
    from megarl.trainer import rl_update

    steps_seen: list = []
    plain = rl_update.rollout_batch

    def recording(groups, cfg, pad_id, *args, **kwargs):  # (rollout_batch's other arguments passed on as they come)
        steps_seen.append([[list(x.prompt_ids), list(x.response_ids)] for g in groups for x in g.samples])
        with open(out, "w") as f:
            json.dump({"mode": cfg.rollout.mode, "steps": steps_seen}, f)
        return plain(groups, cfg, pad_id, *args, **kwargs)

    rl_update.rollout_batch = recording
    with tempfile.TemporaryDirectory() as tmp:
        code = cli.main(["train", "--config", "configs/demo.yaml", f"train.run_dir={tmp}/run",
                         f"model.path={tmp}/model", f"warmup.steps={warmup}", f"train.steps={steps}",
                         "train.time_limit_s=0", "train.save_every=0", "data.eval_size=4",
                         *([f"rollout.mode={mode}"] if mode else []), *TASK_SETTINGS[task]])
    if code:
        raise SystemExit(f"megarl train for {task}'s rollouts exited {code}")


def rollout_batch(samples: list, seed: int = 0):
    """A recorded step's samples as a batch (behaviour logprobs and advantages filled in by the bench)."""
    from megarl.algo.batch import build_batch

    g = torch.Generator().manual_seed(seed)
    adv = (torch.rand(len(samples), generator=g) * 2 - 1).tolist()
    return build_batch([p for p, _ in samples], [r for _, r in samples], [[-1.0] * len(r) for _, r in samples], adv)


def measure(repeats: int, max_tokens: int, tasks: list[str], rows: int, group: int,
            recorded: dict | None = None) -> dict:
    from megarl.algo.objective import policy_loss_fn
    from megarl.compat.megatron import activate_cpu
    from megarl.config.schema import AlgoConfig, OptimConfig
    from megarl.distributed.parallel import build_parallel_state
    from megarl.models.hf_config import read_hf_config
    from megarl.models.tiny import TinyShape, build_tokenizer, make_tiny_model
    from megarl.trainer.policy import PolicyTrainer

    out = {"host": host(), "repeats": repeats, "threads": torch.get_num_threads(), "tasks": {},
           "batches": "recorded rollouts" if recorded else "reference answers"}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(f"{tmp}/m", TinyShape(family="qwen3_moe"), seed=0)
        ps = build_parallel_state()
        activate_cpu()
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)
        cfg, tok = read_hf_config(path), build_tokenizer()
        optim = OptimConfig(lr=1e-6, micro_batch_size=64)
        variants = {"padded": dict(packing=False), "packed_rows": dict(packing=True),
                    "packed_tokens": dict(packing=True, max_tokens_per_microbatch=max_tokens)}
        trainers = {name: PolicyTrainer(cfg, str(path), ps, dataclasses.replace(optim), **kw)
                    for name, kw in variants.items()}
        loss = policy_loss_fn(AlgoConfig(clip_high=0.28))
        for task_name in tasks:
            if recorded:
                batch = rollout_batch(recorded[task_name])
            else:
                batch = task_batch(TASKS[task_name], tok, rows, group)
            batch.old_logprobs = trainers["padded"].logprobs(batch) * batch.loss_mask
            lengths = batch.row_lengths()
            tokens = sum(lengths)
            times: dict[str, list[float]] = {name: [] for name in trainers}
            cpu: dict[str, list[float]] = {name: [] for name in trainers}
            for t in trainers.values():  # warm-up
                t.train_step(batch, loss)
            for _ in range(repeats):  # interleaved: each repeat steps every trainer once
                for name, t in trainers.items():
                    start, start_cpu = time.perf_counter(), time.process_time()
                    t.train_step(batch, loss)
                    times[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - start_cpu)
            med = {name: statistics.median(ts) for name, ts in times.items()}
            med_cpu = {name: statistics.median(ts) for name, ts in cpu.items()}
            plan = trainers["packed_tokens"]._plan(batch)[0]
            out["tasks"][task_name] = {
                "rows": len(lengths), "tokens": tokens, "padded_positions": len(lengths) * batch.seq_len,
                "padding_share": 1 - tokens / (len(lengths) * batch.seq_len), "longest": max(lengths),
                "mean_length": tokens / len(lengths), "microbatches_by_tokens": len(plan),
                "step_s": med, "tokens_per_s": {n: tokens / s for n, s in med.items()},
                "vs_padded": {n: med["padded"] / s for n, s in med.items()},
                "cpu_s": med_cpu, "vs_padded_per_cpu_s": {n: med_cpu["padded"] / s for n, s in med_cpu.items()},
                "step_s_all": times, "load": os.getloadavg()[0],
            }
            print(json.dumps({task_name: {k: v for k, v in out["tasks"][task_name].items() if k != "step_s_all"}}),
                  flush=True)
    out["host_after"] = host()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="interleaved steps of each trainer (after one warm-up)")
    p.add_argument("--max-tokens", type=int, default=4096, help="trainer.max_tokens_per_microbatch of packed_tokens")
    p.add_argument("--tasks", default="demo,long_tail", help="comma-separated: demo, long_tail")
    p.add_argument("--rows", type=int, default=256, help="samples in the batch (prompts_per_step × samples_per_prompt)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--rollouts", action="store_true", help="real rollout batches from a short megarl train per task")
    p.add_argument("--warmup", type=int, default=100, help="with --rollouts: supervised warm-up steps")
    p.add_argument("--rl-steps", type=int, default=3, help="with --rollouts: RL steps (the last one's batch is used)")
    p.add_argument("--mode",
                   help="with --rollouts: rollout.mode (sync, on_policy, partial; default: the config's, sync)")
    p.add_argument("--save", help="with --rollouts: write the recorded batches to this JSON file")
    p.add_argument("--rollouts-from", help="the batches of an earlier --rollouts --save instead of recording")
    p.add_argument("--record", nargs=2, metavar=("TASK", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.record:
        record_rollouts(args.record[0], args.record[1], args.warmup, args.rl_steps, args.mode)
        return
    recorded, modes = None, set()
    if args.rollouts_from:
        with open(args.rollouts_from) as f:
            saved = json.load(f)
        recorded, modes = saved["batches"], {saved["mode"]}
        if missing := [t for t in args.tasks.split(",") if t not in recorded]:
            raise SystemExit(f"{args.rollouts_from} holds no batch of {', '.join(missing)} (it holds "
                             f"{', '.join(sorted(recorded))}): name those with --tasks")
    elif args.rollouts:  # each task's run in a process of its own (megatron keeps process-global state)
        recorded = {}
        with tempfile.TemporaryDirectory() as tmp:
            for task in args.tasks.split(","):
                out = f"{tmp}/{task}.json"
                subprocess.run([sys.executable, __file__, "--record", task, out, "--warmup", str(args.warmup),
                                "--rl-steps", str(args.rl_steps), *(["--mode", args.mode] if args.mode else [])],
                               check=True,
                               cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
                with open(out) as f:
                    run = json.load(f)
                recorded[task] = run["steps"][-1]
                modes.add(run["mode"])
        if args.save:
            with open(args.save, "w") as f:
                json.dump({"mode": ",".join(sorted(modes)), "batches": recorded}, f)
    from megarl.distributed.placement import apply, available_cores, place_node

    apply(place_node(available_cores(), 1, [], together=False).trainer[0])  # megarl's choice for a lone trainer
    result = measure(args.repeats, args.max_tokens, args.tasks.split(","), args.rows, args.group, recorded)
    if recorded:
        result["batches"] += f", rollout.mode={','.join(sorted(modes))}"
    print(json.dumps(result))
    for name, r in result["tasks"].items():
        v = r["vs_padded"]
        c = r["vs_padded_per_cpu_s"]
        print(f"{name}: {r['rows']} rows, {r['tokens']} tokens, {100 * r['padding_share']:.0f}% padding when padded; "
              f"packed by rows {v['packed_rows']:.2f}x, by tokens {v['packed_tokens']:.2f}x padded's tokens/s "
              f"({r['tokens_per_s']['padded']:.0f} tokens/s padded); per CPU second {c['packed_rows']:.2f}x, "
              f"{c['packed_tokens']:.2f}x")
    print(f"batches: {result['batches']}; host: {result['host']} (after: {result['host_after']})")


if __name__ == "__main__":
    main()
