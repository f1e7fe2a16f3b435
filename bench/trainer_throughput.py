#!/usr/bin/env python
"""Trainer figures, each measured side by side in one run:

1. throughput: training tokens/s of the megatron-core trainer (padded, and packed: ``trainer.packing``) vs a plain
   HF transformers model of the same config (rows padded to the longest) on the same batch (forward + backward +
   Adam step), steps interleaved, medians as ratios; on a batch of equal lengths and on the long-tail task's batch;
2. logprob memory: peak resident memory of per-token logprobs + backward from final hidden states,
   naive (full [tokens × vocab] logits, log_softmax) vs megarl's chunked path, vocab 151,936.

    .venv/bin/python bench/trainer_throughput.py [--tokens 4096] [--vocab 151936] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def peak_logprob_memory(mode: str, tokens: int, vocab: int, hidden: int, chunk: int) -> dict:
    """Run in a fresh process: peak RSS growth while computing logprobs and their gradients."""
    from megarl.compat.megatron import activate_cpu
    from megarl.distributed.parallel import build_parallel_state
    from megarl.trainer.logprobs import chunked_token_logprobs

    build_parallel_state()
    activate_cpu()
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(1, tokens, hidden, generator=g) * 0.1).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if mode == "naive":
        logp = torch.log_softmax(h @ w.t(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    else:
        logp = chunked_token_logprobs(h, w, labels, 1.0, chunk)
    logp.sum().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "peak_extra_mib": (peak - base) / 1024, "seconds": seconds,
            "logprob_sum": float(logp.sum()), "grad_norm": float(w.grad.norm())}


def long_tail_rows(rows: int, group: int = 8, seed: int = 0) -> list[list[int]]:
    """``rows`` sequences (prompt + reference answer + EOS, the answer cut at 128 tokens) of the addition task on the
    long tail (``data.max_digits=12 data.tail_alpha=0.5``), ``group`` per prompt, in the tiny tokenizer's ids."""
    from megarl.data import encode
    from megarl.data.addition import AdditionTask
    from megarl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    out = []
    for p in AdditionTask(12, 0.5, seed=seed, eval_size=0).next_problems(max(1, rows // group)):
        answer = (encode(tok, p.response) + [tok.eos_token_id])[:128]
        out.extend([encode(tok, p.prompt) + answer] * group)
    return out[:rows]


def trainer_throughput(steps: int, batch: int, seq: int) -> dict:
    """Training tokens/s (forward + backward + Adam step) of the megatron-core trainer, padded and packed
    (``trainer.packing``), and of a plain HF transformers model (rows padded to the longest, attention mask), on two
    batches: ``batch`` × ``seq`` random tokens (equal lengths: no padding anywhere) and the long-tail batch. Steps are
    interleaved (each repeat steps each trainer once) and the medians compared, per wall second and per CPU second of
    the process; tokens are the rows' own."""
    from transformers import AutoModelForCausalLM

    from megarl.algo.batch import build_batch
    from megarl.algo.losses import nll_loss
    from megarl.compat.megatron import activate_cpu
    from megarl.config.schema import OptimConfig
    from megarl.distributed.parallel import build_parallel_state
    from megarl.models.hf_config import read_hf_config
    from megarl.models.tiny import make_tiny_model
    from megarl.trainer.policy import PolicyTrainer

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(f"{tmp}/m")
        ps = build_parallel_state()
        activate_cpu()
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)
        cfg = read_hf_config(path)
        g = torch.Generator().manual_seed(0)
        batches = {"equal": torch.randint(2, 17, (batch, seq), generator=g).tolist(),
                   "long_tail": long_tail_rows(batch * 8)}
        optim = OptimConfig(lr=1e-4, micro_batch_size=batch * 8)
        trainers = {"megatron_padded": PolicyTrainer(cfg, str(path), ps, optim),
                    "megatron_packed": PolicyTrainer(cfg, str(path), ps, optim, packing=True)}
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        opt = torch.optim.AdamW(hf.parameters(), lr=1e-4)
        result = {}
        for name, rows in batches.items():
            b = build_batch([t[:8] for t in rows], [t[8:] for t in rows])
            width = max(len(t) for t in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            attention = torch.zeros(len(rows), width, dtype=torch.long)
            for i, t in enumerate(rows):
                ids[i, :len(t)], attention[i, :len(t)] = torch.tensor(t), 1
            real = attention[:, 1:].float()
            n_tokens = int(real.sum())

            def hf_step(ids=ids, attention=attention, real=real):
                out = hf(ids[:, :-1], attention_mask=attention[:, :-1])
                logp = torch.log_softmax(out.logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
                (-(logp * real).sum() / real.sum()).backward()
                opt.step()
                opt.zero_grad()

            steps_of = {n: (lambda t=t, b=b: t.train_step(b, lambda lp, mb: nll_loss(lp, mb["loss_mask"])))
                        for n, t in trainers.items()}
            steps_of["hf_padded"] = hf_step
            times: dict[str, list[float]] = {n: [] for n in steps_of}
            cpu: dict[str, list[float]] = {n: [] for n in steps_of}
            for fn in steps_of.values():
                fn()  # warm-up
            for _ in range(steps):
                for n, fn in steps_of.items():
                    start, start_cpu = time.perf_counter(), time.process_time()
                    fn()
                    times[n].append(time.perf_counter() - start)
                    cpu[n].append(time.process_time() - start_cpu)
            rate = {n: n_tokens / statistics.median(ts) for n, ts in times.items()}
            per_cpu = {n: n_tokens / statistics.median(ts) for n, ts in cpu.items()}
            result[name] = {"rows": len(rows), "tokens": n_tokens, "padded_positions": len(rows) * (width - 1),
                            **{f"{n}_tokens_per_s": r for n, r in rate.items()},
                            "packed_over_hf": rate["megatron_packed"] / rate["hf_padded"],
                            "padded_over_hf": rate["megatron_padded"] / rate["hf_padded"],
                            "packed_over_hf_per_cpu_s": per_cpu["megatron_packed"] / per_cpu["hf_padded"],
                            "padded_over_hf_per_cpu_s": per_cpu["megatron_padded"] / per_cpu["hf_padded"],
                            "step_s": times}
        return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--steps", type=int, default=5, help="interleaved repeats (after one warm-up)")
    p.add_argument("--batch", type=int, default=32, help="rows of the equal-length batch (the long tail: 8x)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--throughput-only", action="store_true", help="skip the logprob memory figures")
    p.add_argument("--memory-only", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = p.parse_args()
    from megarl.distributed.placement import apply, available_cores, place_node

    apply(place_node(available_cores(), 1, [], together=False).trainer[0])  # megarl's choice for a lone trainer
    if args.memory_only:
        print(json.dumps(peak_logprob_memory(args.memory_only, args.tokens, args.vocab, args.hidden, args.chunk)))
        return
    load = os.getloadavg()[0]
    throughput = trainer_throughput(args.steps, args.batch, args.seq)
    print(json.dumps({"throughput": throughput, "load": [load, os.getloadavg()[0]],
                      "threads": torch.get_num_threads()}), flush=True)
    for name, r in throughput.items():
        print(f"{name}: {r['rows']} rows, {r['tokens']} tokens ({r['padded_positions']} padded): megatron packed "
              f"{r['packed_over_hf']:.2f}x, padded {r['padded_over_hf']:.2f}x HF padded's tokens/s (per CPU second: "
              f"{r['packed_over_hf_per_cpu_s']:.2f}x, {r['padded_over_hf_per_cpu_s']:.2f}x)")
    if args.throughput_only:
        return
    mem = {}
    for mode in ("naive", "chunked"):
        cmd = [sys.executable, __file__, "--memory-only", mode, "--tokens", str(args.tokens), "--vocab",
               str(args.vocab), "--hidden", str(args.hidden), "--chunk", str(args.chunk)]
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode:
            raise SystemExit(out.stderr[-2000:])
        mem[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    ratio = mem["naive"]["peak_extra_mib"] / max(mem["chunked"]["peak_extra_mib"], 1e-9)
    same = abs(mem["naive"]["logprob_sum"] - mem["chunked"]["logprob_sum"]) <= 1e-3 * abs(mem["naive"]["logprob_sum"])
    print(json.dumps({"logprob_memory": mem, "naive_over_chunked_peak": ratio, "same_result": same}))
    print(f"logprobs at vocab {args.vocab}, {args.tokens} tokens: naive peak {mem['naive']['peak_extra_mib']:.0f} MiB, "
          f"chunked {mem['chunked']['peak_extra_mib']:.0f} MiB ({ratio:.1f}x less)")


if __name__ == "__main__":
    main()
