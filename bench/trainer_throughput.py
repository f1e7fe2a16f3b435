#!/usr/bin/env python
"""Trainer figures, each measured side by side in one run:

1. throughput: training tokens/s of the megatron-core trainer vs a plain HF transformers model of the
   same config on the same batch (forward + backward + Adam step), printed as a ratio;
2. logprob memory: peak resident memory of per-token logprobs + backward from final hidden states,
   naive (full [tokens × vocab] logits, log_softmax) vs megarl's chunked path, vocab 151,936.

    .venv/bin/python bench/trainer_throughput.py [--tokens 4096] [--vocab 151936] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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


def trainer_throughput(steps: int, batch: int, seq: int) -> dict:
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
        tokens = torch.randint(2, 17, (batch, seq), generator=g).tolist()
        b = build_batch([t[:8] for t in tokens], [t[8:] for t in tokens])
        trainer = PolicyTrainer(cfg, str(path), ps, OptimConfig(lr=1e-4, micro_batch_size=batch))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        opt = torch.optim.AdamW(hf.parameters(), lr=1e-4)
        ids = torch.tensor(tokens)
        n_tokens = batch * (seq - 1)

        def hf_step():
            out = hf(ids[:, :-1])
            logp = torch.log_softmax(out.logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            (-logp.mean()).backward()
            opt.step()
            opt.zero_grad()

        def mc_step():
            trainer.train_step(b, lambda lp, mb: nll_loss(lp, mb["loss_mask"]))

        result = {}
        for name, fn in (("megatron", mc_step), ("hf", hf_step)):
            fn()  # warm-up
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            result[f"{name}_tokens_per_s"] = steps * n_tokens / (time.perf_counter() - start)
        result["ratio_megatron_over_hf"] = result["megatron_tokens_per_s"] / result["hf_tokens_per_s"]
        return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--memory-only", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_only:
        print(json.dumps(peak_logprob_memory(args.memory_only, args.tokens, args.vocab, args.hidden, args.chunk)))
        return
    print(json.dumps({"throughput": trainer_throughput(args.steps, args.batch, args.seq)}), flush=True)
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
