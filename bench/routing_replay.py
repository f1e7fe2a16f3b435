#!/usr/bin/env python
"""MoE routing replay (``algo.routing_replay``): what the engine and the trainer disagree on, what replay fixes,
and what it costs, on a bf16 vLLM CPU engine and a bf16 megatron-core trainer.

For each model (the tiny Qwen3-MoE of the tests; a larger one of a few hundred MB: ``--large``; one of 64 experts,
top-8: ``--many-experts``), in fresh processes:

- engine: ``--prompts`` random prompts × ``--samples`` samples of ``--new`` tokens through the slot face the
  controller drives, with route capture (prefix caching off, as replay runs) and without (prefix caching on, as a
  run without replay does), interleaved over ``--repeats`` rounds: decode seconds, the ratio (median), and the
  bytes of the captured routes per token and per batch;
- trainer: the captured samples as one batch; the logprob pass without replay, its routers in bf16 (megarl before
  it set ``moe_router_dtype``) and in fp32 (what a bf16 trainer runs), and with replay: route agreement
  (``moe/route_agreement``: token-layer top-k sets equal), flipped tokens (``moe/route_flip_tokens``), the
  trainer/engine logprob gap (mean and p99 over response tokens) and the pass's seconds.

    .venv/bin/python bench/routing_replay.py [--repeats 3] [--large] [--many-experts]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# a MoE of ~120 M parameters (~240 MB in bf16): 8 layers of 16 experts, top-4
LARGE = dict(hidden_size=384, num_layers=8, num_heads=6, num_kv_heads=2, head_dim=64, intermediate_size=1024,
             num_experts=16, experts_per_token=4, moe_intermediate_size=768, vocab_size=4096)
# 64 experts, top-8 (Qwen3-30B-A3B routes 8 of 128): more near-ties among the scores
MANY_EXPERTS = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512,
                    num_experts=64, experts_per_token=8, moe_intermediate_size=128, vocab_size=1024)
PASSES = (("none", None, "without replay, router bf16"), ("none", "fp32", "without replay, router fp32"),
          ("rollout", "fp32", "with replay (R3)"))
"""The trainer's passes: ``algo.routing_replay``, the routers' ``moe_router_dtype`` (None: the bf16 model's), label."""


def engine_part(model: str, capture: bool, prompts: int, samples: int, new: int, out: str) -> dict:
    import torch

    from megarl.engines.vllm_engine import VLLMEngine, VLLMSlotEngine, set_cpu_engine_env

    set_cpu_engine_env(1)
    from megarl.distributed.parallel import init_process_group
    from megarl.engines.routes import step_samples
    from megarl.models.hf_config import num_experts, read_hf_config
    from megarl.types import Sample, SlotRequest

    init_process_group()
    hf = read_hf_config(model)
    engine = VLLMEngine(model, max_model_len=64 + new, kv_cache_gib=1, seed=0, max_num_seqs=prompts * samples,
                        dtype="bfloat16", route_experts=num_experts(hf) if capture else 0)
    slots = VLLMSlotEngine(engine, slots=prompts * samples)
    g = torch.Generator().manual_seed(5)
    heads = [torch.randint(3, hf["vocab_size"], (16,), generator=g).tolist() for _ in range(prompts)]
    running = {}
    for i, p in enumerate(heads):
        for j in range(samples):
            s = Sample(prompt_ids=p)
            slots.submit(SlotRequest(f"{i}:{j}", p, new, 1.0))
            running[f"{i}:{j}"] = s
    done = dict(running)
    torch.manual_seed(0)
    start = time.perf_counter()
    steps = step_samples(slots, running)
    seconds = time.perf_counter() - start
    tokens = sum(len(s.response_ids) for s in done.values())
    routes = [s.route_array() for s in done.values()]
    if capture:
        torch.save([dict(prompt=s.prompt_ids, response=s.response_ids, logprobs=s.logprobs, routes=r)
                    for s, r in zip(done.values(), routes)], out)
    route_bytes = sum(r.nbytes for r in routes if r is not None)
    positions = sum(len(r) for r in routes if r is not None)
    return {"decode_s": seconds, "steps": steps, "tokens": tokens, "route_bytes": route_bytes,
            "bytes_per_token": route_bytes / positions if positions else 0.0}


def trainer_part(model: str, samples_file: str) -> dict:
    import torch

    from megarl.algo.batch import batch_routes, build_batch
    from megarl.compat.megatron import activate_cpu
    from megarl.config.schema import OptimConfig
    from megarl.distributed.parallel import build_parallel_state
    from megarl.models.hf_config import read_hf_config
    from megarl.trainer.policy import PolicyTrainer

    ps = build_parallel_state()
    activate_cpu()
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    hf = read_hf_config(model)
    trainer = PolicyTrainer(hf, model, ps, OptimConfig(micro_batch_size=16, logprob_chunk=64), trainable=False,
                            precision="bf16")
    rows = torch.load(samples_file, weights_only=False)
    batch = build_batch([r["prompt"] for r in rows], [r["response"] for r in rows], [r["logprobs"] for r in rows])
    batch.routes = batch_routes([r["routes"] for r in rows], batch.seq_len)
    out = {}
    for mode, router, label in PASSES * 2:  # the first pass of each warms up; the second is timed
        trainer.routing_replay = mode
        for m in trainer.modules:  # (read by each router's forward)
            m.config.moe_router_dtype = router
        start = time.perf_counter()
        logprobs = trainer.logprobs(batch)
        seconds = time.perf_counter() - start
        gap = ((logprobs - batch.old_logprobs).abs())[batch.loss_mask.bool()]
        out[label] = {"agreement": trainer.route_stats["moe/route_agreement"],
                     "flip_tokens": trainer.route_stats["moe/route_flip_tokens"],
                     "gap_mean": float(gap.mean()), "gap_p99": float(torch.quantile(gap.float(), 0.99)),
                     "pass_s": seconds}
    return out


def _part(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{args} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def bench(name: str, model: Path, work: Path, args) -> None:
    samples = work / f"{name}.pt"
    runs = {True: [], False: []}
    for _ in range(args.repeats):
        for capture in (False, True):
            runs[capture].append(_part(["--part", "engine", "--model", str(model), "--capture", str(int(capture)),
                                        "--prompts", str(args.prompts), "--samples", str(args.samples),
                                        "--new", str(args.new), "--out", str(samples)]))
    ratio = statistics.median(c["decode_s"] / p["decode_s"] for c, p in zip(runs[True], runs[False]))
    eng = runs[True][-1]
    tr = _part(["--part", "trainer", "--model", str(model), "--samples-file", str(samples)])
    print(f"\n## {name}: {args.prompts} prompts × {args.samples} samples × {args.new} tokens, bf16 engine and trainer")
    print(f"engine decode s, no capture / capture (median of {args.repeats}): "
          f"{statistics.median(r['decode_s'] for r in runs[False]):.2f} / "
          f"{statistics.median(r['decode_s'] for r in runs[True]):.2f}  → capture costs ×{ratio:.3f}")
    print(f"routes: {eng['bytes_per_token']:.0f} B per token, {eng['route_bytes'] / 2**20:.2f} MiB for the batch")
    print("| trainer pass | route agreement | flipped tokens | logprob gap mean | gap p99 | pass s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for _, _, label in PASSES:
        r = tr[label]
        print(f"| {label} | {r['agreement']:.4f} | {r['flip_tokens']:.4f} | {r['gap_mean']:.4f} | "
              f"{r['gap_p99']:.4f} | {r['pass_s']:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["engine", "trainer"])
    p.add_argument("--model")
    p.add_argument("--capture", type=int, default=1)
    p.add_argument("--samples-file", dest="samples_file")
    p.add_argument("--out", default="")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--large", action="store_true", help="also the ~120 M-parameter MoE")
    p.add_argument("--many-experts", dest="many_experts", action="store_true", help="also a MoE of 64 experts, top-8")
    args = p.parse_args()
    if args.part == "engine":
        print(json.dumps(engine_part(args.model, bool(args.capture), args.prompts, args.samples, args.new, args.out)))
        return
    if args.part == "trainer":
        print(json.dumps(trainer_part(args.model, args.samples_file)))
        return
    from megarl.models.tiny import TinyShape, make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        bench("tiny Qwen3-MoE (4 layers × 4 experts, top-2)",
              make_tiny_model(work / "tiny", TinyShape(family="qwen3_moe"), seed=3), work, args)
        if args.large:
            bench("Qwen3-MoE, 8 layers × 16 experts, top-4 (~120 M parameters)",
                  make_tiny_model(work / "large", TinyShape(family="qwen3_moe", **LARGE), seed=3), work, args)
        if args.many_experts:
            bench("Qwen3-MoE, 4 layers × 64 experts, top-8",
                  make_tiny_model(work / "many", TinyShape(family="qwen3_moe", **MANY_EXPERTS), seed=3), work, args)


if __name__ == "__main__":
    main()
