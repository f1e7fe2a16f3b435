#!/usr/bin/env python
"""Compare an HF checkpoint and a megatron dist checkpoint of it: logits on a few prompts.

    python tools/check_conversion.py --hf /models/Qwen3-8B --ckpt ckpt/q8b
    python tools/check_conversion.py --hf runs/x/hf/step_100 --ckpt runs/x/checkpoints/step_000100 --tol 1e-3

``--ckpt``: a dist checkpoint, a run's checkpoint step dir (its ``policy/``) or a run dir (its latest step's).

Runs transformers on the HF directory and the megatron trainer's model (one process, fp32)
built from it with the dist checkpoint loaded over its weights, on a few prompts; prints max
|logit difference| and the mean KL(HF ‖ megatron) per token, then one line
``check_conversion: PASS`` or ``FAIL`` (exit status 0 or 1; 2: ``--ckpt`` names no dist checkpoint).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

PROMPTS = ["The capital of France is", "def fibonacci(n):", "12+34=", "Once upon a time, there was"]


def prompt_ids(hf_dir: str, vocab: int) -> list[list[int]]:
    """The prompts through the checkpoint's tokenizer, or fixed random ids when it has none."""
    import torch

    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(hf_dir)
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
        if all(ids):
            return ids
    except (OSError, ValueError):
        pass
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (12,), generator=g).tolist() for _ in PROMPTS]


def compare(hf_dir: str, ckpt: str) -> dict:
    from megarl.checkpoint.identity import check_same_model
    from megarl.models.hf_config import read_hf_config

    cfg = read_hf_config(hf_dir, "--hf")
    check_same_model(ckpt, cfg, f"--hf {hf_dir}")  # mcore-to-hf's check: a tensor left unloaded is another model
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.checkpoint.dist import load_checkpoint
    from megarl.compat.megatron import activate_cpu
    from megarl.config.schema import OptimConfig
    from megarl.distributed.parallel import build_parallel_state
    from megarl.trainer.policy import PolicyTrainer

    ps = build_parallel_state()
    activate_cpu()
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    trainer = PolicyTrainer(cfg, hf_dir, ps, OptimConfig(logprob_chunk=0), trainable=False)
    load_checkpoint(trainer, ckpt, load_optimizer=False)  # (loads the tensors the model asks for: checked above)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    worst, kls, tokens = 0.0, 0.0, 0
    with torch.no_grad():
        for ids in prompt_ids(hf_dir, cfg["vocab_size"]):
            x = torch.tensor([ids])
            ours = trainer.modules[0](x, torch.arange(len(ids)).unsqueeze(0), None).float()
            theirs = hf(x).logits.float()
            worst = max(worst, float((ours - theirs).abs().max()))
            p = torch.log_softmax(theirs, -1)
            kls += float((p.exp() * (p - torch.log_softmax(ours, -1))).sum())
            tokens += len(ids)
    return {"max_abs_logit_diff": worst, "kl_per_token": kls / tokens, "prompts": len(PROMPTS), "tokens": tokens}


def load_error(exc: BaseException) -> str:
    """The useful part of a load error: torch's CheckpointException carries each rank's whole traceback,
    whose last line (the exception naming the tensor) is what says what went wrong."""
    text = str(exc)
    if "Traceback (most recent call last)" not in text:
        return f"{type(exc).__name__}: {text}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf", required=True, help="HF checkpoint directory")
    parser.add_argument("--ckpt", required=True,
                        help="megatron dist checkpoint directory, a run's checkpoint step dir or a run dir "
                             "(its policy)")
    parser.add_argument("--tol", type=float, default=1e-3, help="largest max |logit difference| that passes")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from pathlib import Path

    from megarl.checkpoint.identity import ModelMismatch
    from megarl.convert.dist_hf import dist_checkpoint_dir

    try:
        args.ckpt = str(dist_checkpoint_dir(Path(args.ckpt)))  # (says which policy/ it took)
    except FileNotFoundError as exc:
        print(f"check_conversion: error: {exc}", file=sys.stderr)
        return 2
    try:
        r = compare(args.hf, args.ckpt)
    except ModelMismatch as exc:
        print(f"check_conversion: FAIL {exc}", flush=True)
        return 1
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        print(f"check_conversion: FAIL {args.ckpt} does not load as {args.hf}'s model: {load_error(exc)}", flush=True)
        return 1
    ok = r["max_abs_logit_diff"] <= args.tol
    print(json.dumps(r))
    print(f"check_conversion: {'PASS' if ok else 'FAIL'} max|Δlogit| {r['max_abs_logit_diff']:.3g} "
          f"(tol {args.tol:g}), KL {r['kl_per_token']:.3g} nats/token over {r['tokens']} tokens")
    return 0 if ok else 1


if __name__ == "__main__":  # the dist-checkpoint reader needs the guard
    sys.exit(main())
