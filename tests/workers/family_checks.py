"""Models written by transformers itself, in the trainer (one process) and in vLLM after a sync.

    python tests/workers/family_checks.py parity WORKDIR NAME [NAME ...]
    python tests/workers/family_checks.py engine WORKDIR NAME

``parity``: for each model of ``tests/hf_models.SPECS``, the trainer's per-token logprobs of a
fixed 64-position batch against transformers' (``gap``; ``packed_gap`` with the rows packed; over the loss mask),
and how far transformers moves when the config's RoPE scaling is removed (``rope_effect``: what a trainer
that ignored it would be off by). ``engine``: vLLM samples, the trainer's logprobs of them,
then one optimizer step, an in-memory sync (``hf_weights`` → vLLM) and the same again.
Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def hf_logprobs(path, batch, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(batch.input_ids).logits  # right-padded rows: causal attention needs no mask
    return torch.log_softmax(logits.float(), -1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1)


def parity(work: str, *names: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
    from helpers.hf_models import make_hf_model
    from helpers.trainers import build_trainer, fixed_batch
    from megarl.config.schema import OptimConfig

    out = {}
    for name in names:
        path = make_hf_model(Path(work) / name, name, seed=3)
        _, cfg, trainer = build_trainer("single", str(path), OptimConfig(micro_batch_size=4))
        batch = fixed_batch(cfg["vocab_size"], seq=64)
        ours, theirs = trainer.logprobs(batch), hf_logprobs(path, batch)
        trainer.packing = True  # the rows packed: RoPE from one table per micro-batch (compat.cache_packed_rope)
        packed = trainer.logprobs(batch)
        plain = hf_logprobs(path, batch, rope_parameters={"rope_type": "default",
                                                          "rope_theta": cfg["rope_parameters"]["rope_theta"]})
        mask = batch.loss_mask
        out[name] = {"gap": float(((ours - theirs).abs() * mask).max()),
                     "packed_gap": float(((packed - theirs).abs() * mask).max()),
                     "scale": float((theirs.abs() * mask).max()),
                     "rope_effect": float(((plain - theirs).abs() * mask).max())}
    print(json.dumps(out), flush=True)


def engine(work: str, name: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
    from helpers.hf_models import make_hf_model
    from megarl.engines.vllm_engine import set_cpu_engine_env

    set_cpu_engine_env(0.25)
    import vllm  # noqa: F401  (before the CPU adapter patches torch.cuda)

    from helpers.trainers import build_trainer, hf_weights
    from megarl.algo.batch import build_batch
    from megarl.algo.losses import nll_loss
    from megarl.config.schema import OptimConfig
    from megarl.distributed.parallel import build_parallel_state
    from megarl.engines.vllm_engine import VLLMEngine
    from megarl.types import GenerationRequest

    build_parallel_state()  # vLLM's external launcher joins this process group
    path = make_hf_model(Path(work) / name, name, seed=3)
    eng = VLLMEngine(str(path), max_model_len=96, kv_cache_gib=0.25, max_num_seqs=16)
    _, cfg, trainer = build_trainer("single", str(path), OptimConfig(lr=3e-3, micro_batch_size=8))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, cfg["vocab_size"], (6,), generator=g).tolist() for _ in range(4)]

    def gap(seed):
        reqs = [GenerationRequest(p, n=2, max_tokens=48, temperature=1.0) for p in prompts]
        outs = eng.generate(reqs, seed=seed)
        batch = build_batch([r.prompt_ids for r, cs in zip(reqs, outs) for _ in cs],
                            [c.token_ids for cs in outs for c in cs], [c.logprobs for cs in outs for c in cs])
        return float(((trainer.logprobs(batch) - batch.old_logprobs) * batch.loss_mask).abs().max()), batch

    result = {"name": name}
    result["gap_before"], batch = gap(1)
    result["tokens"] = int(batch.loss_mask.sum())
    before = dict(hf_weights(trainer))
    trainer.train_step(batch, lambda lp, mb: nll_loss(lp, mb["loss_mask"]))
    synced = dict(hf_weights(trainer))
    result["moved"] = max(float((synced[k] - before[k]).abs().max()) for k in before)
    result["names"] = sorted(synced)
    eng.update_weights(synced.items())
    result["gap_after"], _ = gap(2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    {"parity": parity, "engine": engine}[sys.argv[1]](*sys.argv[2:])
    from helpers.processes import end_process_group  # (tests/ is on the worker's path)
    end_process_group()  # gloo ended before the interpreter's teardown
