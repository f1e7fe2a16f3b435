"""Weight sync into a bf16 vLLM engine in the trainer's process (real vLLM CPU, real megatron-core).

    python tests/workers/bf16_sync_checks.py MODEL_DIR

A trainer in bf16 and one in fp32 each take two PPO steps and stream their weights into the same bfloat16
engine through the loop's sync (``StreamingSync``: buckets in the engine's dtype). After each sync every engine
weight is read back: plain tensors (embedding, norms, lm_head) as they are, the linear layers that vLLM's CPU
backend repacked for oneDNN through the layer itself on an identity matrix (exact: one product of 1.0 per output,
accumulated in fp32, rounded to bf16; on a GPU they are plain tensors). Prints, per trainer, how many HF tensors equal
the trainer's own bit for bit (the bf16 trainer's as they are, the fp32 trainer's rounded to bf16), the bytes sent, and
the trainer/engine logprob gap.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers.trainers import build_trainer, fixed_batch  # noqa: E402

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def engine_weights(engine) -> dict[str, torch.Tensor]:
    """The engine's weights under its own (fused) names, [out, in] for linear layers."""
    model = engine.worker.model_runner.get_model()
    out = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        if weight.numel() == 0 and hasattr(module, "quant_method"):  # repacked: read through the layer
            eye = torch.eye(module.input_size_per_partition, dtype=weight.dtype, device=weight.device)
            out[f"{name}.weight"] = module.quant_method.apply(module, eye).t().contiguous().cpu()
        else:  # (on a GPU every weight is a plain tensor)
            out[f"{name}.weight"] = weight.detach().cpu()
    return out


def as_engine_names(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors under vLLM's fused names (q/k/v → qkv_proj, gate/up → gate_up_proj), weights only."""
    out = {}
    for name, t in hf.items():
        if not name.endswith(".weight"):
            continue
        stem, _, leaf = name[: -len(".weight")].rpartition(".")
        fused = next((f for f, parts in FUSED.items() if leaf in parts), None)
        if fused is None:
            out[name] = t
        elif leaf == FUSED[fused][0]:
            out[f"{stem}.{fused}.weight"] = torch.cat([hf[f"{stem}.{p}.weight"] for p in FUSED[fused]])
    return out


def main(model_dir: str) -> None:
    from megarl.engines.vllm_engine import VLLMEngine, set_cpu_engine_env

    set_cpu_engine_env(0.25)
    import vllm  # noqa: F401  (before the CPU adapter patches torch.cuda)

    from megarl.distributed.parallel import init_process_group

    init_process_group()
    engine = VLLMEngine(model_dir, max_model_len=64, kv_cache_gib=0.25, seed=0, max_num_seqs=8, dtype="bfloat16")
    from megatron.core import parallel_state as mpu

    from helpers.trainers import hf_weights
    from megarl.algo.losses import ppo_clip_loss
    from megarl.config.schema import OptimConfig
    from megarl.weight_sync.protocol import logprob_gap
    from megarl.weight_sync.streaming import StreamingSync

    results = {}
    for layout, precision in (("bf16_single", "bf16"), ("single", "fp32")):
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        ps, cfg, trainer = build_trainer(layout, model_dir, OptimConfig(lr=3e-3, micro_batch_size=4, grad_clip=1.0))
        batch = fixed_batch(cfg["vocab_size"])
        for _ in range(2):
            trainer.train_step(batch, lambda lp, mb: ppo_clip_loss(lp, mb["old_logprobs"], mb["advantages"],
                                                                   mb["loss_mask"], 0.2, 0.28))
        sync = StreamingSync.of(trainer, engine.dtype, 1 / 16)
        engine.update_weights(sync.weights())
        want = {k: v.to(torch.bfloat16).cpu() for k, v in as_engine_names(dict(hf_weights(trainer))).items()}
        got = engine_weights(engine)
        results[precision] = {
            "names": sorted(want) == sorted(got), "tensors": len(want),
            "bitwise_equal": sum(torch.equal(got[k], want[k]) for k in want if k in got),
            "trainer_dtypes": sorted({str(t.dtype) for t in dict(hf_weights(trainer)).values()}),
            "bucket_dtype": str(sync.dtype), "bytes": sync.stats.bytes,
            "params": sum(t.numel() for t in dict(hf_weights(trainer)).values()),
            "gap": logprob_gap(engine, trainer, seed=3),
            "eager": engine._args["enforce_eager"],  # engine.enforce_eager=auto: eager on CPU, CUDA graphs on GPUs
        }
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
