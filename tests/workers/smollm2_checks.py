"""Logprobs of the real SmolLM2-135M-Instruct: megarl's megatron-core trainer against transformers' own model, and
the bf16 vLLM CPU engine against the bf16 trainer, on the engine's own greedy answers to chat prompts.

    python tests/workers/smollm2_checks.py MODEL_DIR

Prints one JSON line: per precision, the largest and mean absolute gap (response tokens) of the trainer against
transformers in that precision, and of the engine (bf16) against the bf16 trainer.
"""

from __future__ import annotations

import json
import os
import sys

import torch

PROMPTS = ["What is 17 + 25? Answer with the number.", "Name the capital of France.",
           "Write one sentence about the sea.", "What is 9 times 7?"]


def gaps(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    d = (a.float() - b.float()).abs() * mask
    return {"max": float(d.max()), "mean": float(d.sum() / mask.sum())}


def transformers_logprobs(model_dir: str, batch, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    with torch.no_grad():
        logits = model(batch.input_ids).logits.float()  # (padding follows each row's tokens: causal, nothing masked)
    return torch.log_softmax(logits, dim=-1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)


def main(model_dir: str) -> None:
    from megarl.engines.vllm_engine import VLLMEngine, set_cpu_engine_env

    set_cpu_engine_env(0.25)
    import vllm  # noqa: F401  (before the CPU adapter patches torch.cuda)

    from megarl.distributed.parallel import build_parallel_state

    ps = build_parallel_state()
    from transformers import AutoTokenizer

    from megarl.algo.batch import build_batch
    from megarl.types import GenerationRequest

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for p in PROMPTS]
    engine = VLLMEngine(model_dir, max_model_len=128, kv_cache_gib=0.25, seed=0, max_num_seqs=8, dtype="bfloat16")
    outs = engine.generate([GenerationRequest(list(p), n=1, max_tokens=24, greedy=True) for p in prompts], seed=0)
    responses, engine_lp = [o[0].token_ids for o in outs], [o[0].logprobs for o in outs]
    batch = build_batch(prompts, responses, engine_lp, [0.0] * len(prompts), pad_id=tok.pad_token_id or 0)
    mask = batch.loss_mask

    from megarl.compat.megatron import activate_cpu

    activate_cpu()
    from megatron.core import tensor_parallel

    from megarl.config.schema import OptimConfig
    from megarl.models.hf_config import read_hf_config
    from megarl.trainer.policy import PolicyTrainer

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    cfg = read_hf_config(model_dir)
    out = {"tokens": int(mask.sum()), "responses": [tok.decode(r) for r in responses]}
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        trainer = PolicyTrainer(cfg, model_dir, ps, OptimConfig(micro_batch_size=4, logprob_chunk=16),
                                trainable=False, precision=precision)
        mine = trainer.logprobs(batch)
        theirs = transformers_logprobs(model_dir, batch, dtype)
        out[precision] = {"vs_transformers": gaps(mine, theirs, mask), "engine_vs_trainer": gaps(batch.old_logprobs,
                                                                                                 mine, mask)}
        del trainer
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main(*sys.argv[1:])
