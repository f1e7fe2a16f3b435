"""The adapter-only sync (``lora.rank`` > 0) on real parts: a megatron-core trainer with LoRA adapters (gloo) → a
colocated vLLM CPU engine serving them as vLLM LoRA adapters.

    python tests/workers/lora_sync_checks.py MODEL_DIR                          (one process)
    torchrun --nproc-per-node 2 tests/workers/lora_sync_checks.py MODEL_DIR tp2 (trainer TP 2 + SP, engine TP 2)
    python tests/workers/lora_sync_checks.py MOE_MODEL_DIR moe                  (an MoE, adapters on attention: the
                                                                                engine wraps those modules alone)

1. The trainer takes a step (B moves off zero); the engine still serves the base: the audit's gap is large.
2. A sync whose adapters are broken (one tensor of the wrong shape, on the last rank) fails on every rank: the
   engine serves what it served before (the base: tokens and logprobs equal, exactly), version unchanged, the
   failure counted.
3. The sync then succeeds: version 1, engine ≈ trainer (the audit), the bytes moved against the full weights'.
4. Another step, no sync: the audit's gap is large again; the next sync serves version 2 as a new adapter id, the
   previous one removed (one adapter held), engine ≈ trainer.
Prints one JSON line (rank 0).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from workers.protocol_checks import probe  # noqa: E402


def main(model_dir: str, layout: str = "single") -> None:
    from megarl.engines.vllm_engine import VLLMEngine, set_cpu_engine_env

    set_cpu_engine_env(0.25)
    import vllm  # noqa: F401  (before the CPU adapter patches torch.cuda)

    from megarl.distributed.parallel import init_process_group

    init_process_group()
    tp = 2 if layout == "tp2" else 1
    from megarl.config.schema import LoraConfig
    from megarl.config.validate.lora import hf_modules

    lora = LoraConfig(rank=4, alpha=8.0, targets="linear_qkv,linear_proj" if layout == "moe" else LoraConfig.targets)
    engine = VLLMEngine(model_dir, max_model_len=64, kv_cache_gib=0.25, tensor_parallel_size=tp, seed=0,
                        max_num_seqs=8, lora_rank=4, lora_modules=hf_modules(lora))

    from megarl.engines.colocated import ColocatedEngines
    from megarl.weight_sync.protocol import WeightSync, logprob_gap

    ps, cfg, trainer, step = lora_trainer("tp2_sp" if layout == "tp2" else "single", model_dir, lora)
    Broken = broken_stream(ps)
    lines: list[str] = []
    engines = ColocatedEngines(engine, 8, tp)
    proto = WeightSync(trainer, engines.dtype, bucket_mib=1, check_every=1, say=lines.append)
    step()
    base = probe(engine, cfg["vocab_size"])
    gap_base = logprob_gap(engines, trainer, seed=3)
    failed = proto.run(engines, 1, stream=Broken.of(trainer, engines.dtype)).metrics()
    after_failure = probe(engine, cfg["vocab_size"])
    ok = proto.run(engines, 1).metrics()
    first_id = engine.lora_request.lora_int_id
    step()
    gap_skipped = logprob_gap(engines, trainer, seed=3)
    again = proto.run(engines, 2).metrics()
    full_bytes = checkpoint_elements(model_dir) * engines.dtype.itemsize
    if ps.rank == 0:
        print(json.dumps({
            "gap_base": gap_base, "failed": failed, "log": lines,
            "same_tokens": [a[0] for a in base] == [b[0] for b in after_failure],
            "logprob_diff_after_failure": max(abs(x - y) for a, b in zip(base, after_failure)
                                              for x, y in zip(a[1], b[1])),
            "ok": ok, "gap_skipped": gap_skipped, "again": again, "first_id": first_id,
            "second_id": engine.lora_request.lora_int_id,
            "held": sorted(engine.worker.model_runner.lora_manager.list_adapters()),
            "full_bytes": full_bytes,
        }), flush=True)


def lora_trainer(layout: str, model_dir: str, lora) -> tuple:
    """A trainer with ``lora``'s adapters at ``layout`` (``helpers.trainers``): its parallel state, model config,
    the trainer, and a step on a fixed PPO batch (it moves B off zero)."""
    from helpers.trainers import build_trainer, fixed_batch
    from megarl.algo.losses import ppo_clip_loss
    from megarl.config.schema import OptimConfig

    ps, cfg, trainer = build_trainer(layout, model_dir, OptimConfig(lr=3e-2, micro_batch_size=4, grad_clip=1.0),
                                     lora=lora)
    batch = fixed_batch(cfg["vocab_size"])

    def step():
        trainer.train_step(batch, lambda lp, mb: ppo_clip_loss(lp, mb["old_logprobs"], mb["advantages"],
                                                               mb["loss_mask"], 0.2, 0.28))

    return ps, cfg, trainer, step


def broken_stream(ps):
    """The adapter stream with one lora_B a row short, on the last rank alone: no rank may serve the adapter."""
    from megarl.weight_sync.adapters import AdapterStream

    class Broken(AdapterStream):
        def tensors(self):
            out = super().tensors()
            if ps.rank != ps.world_size - 1:
                return out
            name = sorted(n for n in out if n.endswith("lora_B.weight"))[0]
            out[name] = out[name][1:]
            return out

    return Broken


def checkpoint_elements(model_dir: str) -> int:
    """The base model's weights in elements: what a full sync moves (the checkpoint's tensors)."""
    import glob
    import math

    from safetensors import safe_open

    total = 0
    for path in glob.glob(os.path.join(model_dir, "*.safetensors")):
        with safe_open(path, "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


if __name__ == "__main__":
    main(*sys.argv[1:])
