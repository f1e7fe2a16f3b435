"""The end-of-run HF export of a trained policy, loaded back by transformers.

    python tests/workers/export_checks.py MODEL_DIR WORK
    python tests/workers/export_checks.py vllm EXPORT_DIR

Trains one step on a fixed batch, exports the policy with ``export_hf`` (100 KB shards, so
there are several and an index), and prints the trainer's logprobs of the batch next to those
transformers computes from the export. ``vllm``: a fresh vLLM engine loads the export; its behaviour
logprobs of what it samples against transformers' on the same tokens.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def main(model_dir: str, work: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
    from transformers import AutoModelForCausalLM

    from helpers.trainers import build_trainer, fixed_batch
    from megarl.algo.losses import nll_loss
    from megarl.config.schema import OptimConfig
    from megarl.convert.export import export_hf

    _, cfg, trainer = build_trainer("single", model_dir, OptimConfig(lr=3e-3, micro_batch_size=4))
    batch = fixed_batch(cfg["vocab_size"], seq=40)
    trainer.train_step(batch, lambda lp, mb: nll_loss(lp, mb["loss_mask"]))
    ours = trainer.logprobs(batch)
    out = export_hf(trainer, model_dir, os.path.join(work, "hf", "step_1"), max_shard_bytes=100_000)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch.input_ids).logits
    theirs = torch.log_softmax(logits.float(), -1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    before = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        old = torch.log_softmax(before(batch.input_ids).logits.float(), -1)
    old = old.gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    mask = batch.loss_mask
    print(json.dumps({"gap": float(((ours - theirs).abs() * mask).max()),
                      "moved": float(((old - theirs).abs() * mask).max()),
                      "files": sorted(os.listdir(out))}), flush=True)


def vllm_loads(export: str) -> None:
    from megarl.engines.vllm_engine import set_cpu_engine_env

    set_cpu_engine_env(0.25)
    from transformers import AutoModelForCausalLM

    from megarl.algo.batch import build_batch
    from megarl.distributed.parallel import build_parallel_state
    from megarl.engines.vllm_engine import VLLMEngine
    from megarl.types import GenerationRequest

    build_parallel_state()  # vLLM's external launcher joins this process group
    engine = VLLMEngine(export, max_model_len=64, kv_cache_gib=0.25, max_num_seqs=8)
    vocab = json.load(open(os.path.join(export, "config.json")))["vocab_size"]
    g = torch.Generator().manual_seed(0)
    reqs = [GenerationRequest(torch.randint(2, vocab, (6,), generator=g).tolist(), max_tokens=16) for _ in range(4)]
    outs = [o[0] for o in engine.generate(reqs, seed=0)]
    batch = build_batch([r.prompt_ids for r in reqs], [o.token_ids for o in outs], [o.logprobs for o in outs])
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch.input_ids).logits
    theirs = torch.log_softmax(logits.float(), -1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)
    print(json.dumps({"tokens": int(batch.loss_mask.sum()),
                      "gap": float(((batch.old_logprobs - theirs).abs() * batch.loss_mask).max())}), flush=True)


if __name__ == "__main__":
    vllm_loads(sys.argv[2]) if sys.argv[1] == "vllm" else main(*sys.argv[1:])
    from helpers.processes import end_process_group  # (tests/ is on the worker's path)
    end_process_group()  # gloo ended before the interpreter's teardown
