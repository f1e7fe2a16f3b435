#!/usr/bin/env python
"""Peak activation memory of one long packed micro-batch's training step: ``trainer.recompute`` none, selective and
full side by side in one run.

Three trainers (fp32, one process) from the same weights of a few-layer model (by default a Qwen2 of hidden 256, 4
layers; ``--layers``, ``--hidden``), each packed with ``trainer.max_tokens_per_microbatch`` = the batch's tokens: one
micro-batch of ``--rows`` rows of ``--row-tokens`` tokens each. Each takes one optimizer step first (Adam's state and
megatron's buffers are allocated then), then ``--repeats`` steps in turn, trainer after trainer; each step's figure is
the growth of the process's peak RSS above its RSS before the step (``/proc/self/clear_refs`` 5 resets the
high-water mark, ``VmHWM`` reads it: ``engines.memory.peak_rss_added``), the largest over repeats. glibc would keep
freed buffers in its heap and hide the next step's: the script runs itself under ``MALLOC_MMAP_THRESHOLD_=65536``
(every larger buffer its own mapping). Also printed: what ``megarl plan``'s formulas say of the same micro-batch
(``launch/memory.py``: activations whole, full recompute's kept inputs plus one unit's working set), and the
step's loss under each mode (the same: recompute changes memory, not results).

    .venv/bin/python bench/recompute_memory.py [--rows 8] [--row-tokens 512] [--layers 4] [--hidden 256]
                                               [--repeats 2] [--recompute-layers 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

from common import host  # (bench/ is on sys.path: the script's own directory)

MODES = ("none", "selective", "full")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--row-tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--recompute-layers", type=int, default=1)
    args = ap.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":  # (glibc reads it at start: run again under it)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        sys.exit(subprocess.run([sys.executable, *sys.argv], env=env).returncode)

    import torch

    from megarl.algo.batch import aggregation_weights, build_batch
    from megarl.algo.objective import policy_loss_fn
    from megarl.compat.megatron import activate_cpu
    from megarl.config.schema import AlgoConfig, OptimConfig
    from megarl.distributed.parallel import build_parallel_state
    from megarl.engines.memory import peak_rss_added
    from megarl.models.hf_config import read_hf_config
    from megarl.models.tiny import TinyShape, make_tiny_model
    from megarl.trainer.policy import PolicyTrainer

    h = args.hidden
    shape = TinyShape(family="qwen2", hidden_size=h, num_layers=args.layers, num_heads=h // 32, num_kv_heads=h // 64,
                      head_dim=32, intermediate_size=2 * h, max_position_embeddings=max(512, args.row_tokens + 8))
    model_dir = make_tiny_model(os.path.join(tempfile.mkdtemp(prefix="recompute_bench_"), "model"), shape, seed=0)
    ps = build_parallel_state()
    activate_cpu()
    from megatron.core import tensor_parallel

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    cfg = read_hf_config(model_dir)
    tokens = args.rows * args.row_tokens
    optim = OptimConfig(lr=1e-5, micro_batch_size=args.rows, logprob_chunk=1024)
    trainers = {mode: PolicyTrainer(cfg, model_dir, ps, optim, packing=True, max_tokens_per_microbatch=tokens,
                                    recompute=mode, recompute_layers=args.recompute_layers) for mode in MODES}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, cfg["vocab_size"], (8,), generator=g).tolist() for _ in range(args.rows)]
    responses = [torch.randint(2, cfg["vocab_size"], (args.row_tokens - 7,), generator=g).tolist()
                 for _ in range(args.rows)]
    batch = build_batch(prompts, responses, [[-3.0] * len(r) for r in responses],
                        (torch.rand(args.rows, generator=g) * 2 - 1).tolist())
    batch.weights = aggregation_weights(batch.loss_mask, "token_mean")
    loss_fn = policy_loss_fn(AlgoConfig())
    losses = {mode: t.train_step(batch, loss_fn)["loss"] for mode, t in trainers.items()}  # (allocates the state)
    peak = {mode: 0 for mode in MODES}
    for _ in range(args.repeats):
        for mode, t in trainers.items():
            peak[mode] = max(peak[mode], peak_rss_added(lambda t=t: t.train_step(dataclasses.replace(batch), loss_fn)))
    layers, w = cfg["num_hidden_layers"], 4
    from megarl.launch.memory import recompute_activation_floats  # (the plan's formula of the same micro-batch)

    planned = {}
    for mode in MODES:
        part = recompute_activation_floats(cfg, mode, args.recompute_layers)
        planned[mode] = (part["kept"] + part["unit"]) * tokens * w
    mib = 1024 ** 2
    out = {"host": host(), "tokens": tokens, "rows": args.rows, "layers": layers, "hidden": h,
           "recompute_layers": args.recompute_layers, "peak_step_mib": {m: round(v / mib, 1) for m, v in peak.items()},
           "ratio_to_none": {m: round(peak["none"] / v, 2) for m, v in peak.items()},
           "plan_activations_mib": {m: round(v / mib, 1) for m, v in planned.items()},
           "plan_ratio_to_none": {m: round(planned["none"] / v, 2) for m, v in planned.items()},
           "first_step_loss": losses}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
