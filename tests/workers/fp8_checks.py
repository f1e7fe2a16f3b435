"""FP8 check on a GPU: the same tiny model in full precision (local spec) and in FP8 (TE spec);
dense, or MoE (TE's grouped-GEMM experts, loaded and exported under the local names).

Usage: python tests/workers/fp8_checks.py RECIPE|none WORKDIR [FAMILY]   (prints one JSON line)
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch


def main(recipe: str, work: str, family: str = "qwen2") -> None:
    from megarl.algo.losses import nll_loss
    from megarl.config.schema import OptimConfig
    from megarl.distributed.parallel import build_parallel_state
    from megarl.models.hf_config import read_hf_config
    from megarl.models.tiny import TinyShape, make_tiny_model
    from megarl.trainer.policy import PolicyTrainer

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
    from helpers.trainers import fixed_batch, hf_weights

    # FP8 GEMMs need dimensions that are multiples of 16.
    model = make_tiny_model(f"{work}/model", TinyShape(family=family, hidden_size=128,
                                                       intermediate_size=256, moe_intermediate_size=128))
    ps = build_parallel_state()
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    cfg = read_hf_config(model)
    batch = fixed_batch(cfg["vocab_size"], n=16, seq=32)
    batch = type(batch)(**{k: v.cuda() for k, v in batch.as_dict().items()})
    ref = PolicyTrainer(cfg, str(model), ps, OptimConfig(lr=1e-3, micro_batch_size=16), trainable=False)
    # recipe 'none': Transformer Engine's spec (grouped expert GEMMs) in full precision, no FP8.
    fp8 = PolicyTrainer(cfg, str(model), ps, OptimConfig(lr=1e-3, micro_batch_size=16),
                        fp8="" if recipe == "none" else recipe, transformer_engine=True,
                        precision="fp32" if recipe == "none" else "bf16")  # FP8 runs on bf16 mixed precision
    gap = ((ref.logprobs(batch) - fp8.logprobs(batch)).abs() * batch.loss_mask).sum() / batch.loss_mask.sum()
    before = {n: p.detach().clone() for n, p in fp8.modules[0].named_parameters()}
    metrics = fp8.train_step(batch, lambda lp, mb: nll_loss(lp, mb["loss_mask"]))
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in fp8.modules[0].named_parameters())
    te = any("layer_norm_weight" in n for n in before)
    exported = dict(hf_weights(fp8))  # TE names back to HF names, every tensor accounted for
    from megarl.models.tiny import hf_weight_shapes

    shapes_match = {k: tuple(v.shape) for k, v in exported.items()} == hf_weight_shapes(cfg)
    # rollout lengths: 7 rows of 29 positions (203 tokens, a multiple of neither 8 nor 16), as rows and packed
    odd = fixed_batch(cfg["vocab_size"], n=7, seq=29)
    odd = type(odd)(**{k: v.cuda() for k, v in odd.as_dict().items()})
    packed = PolicyTrainer(cfg, str(model), ps, OptimConfig(lr=1e-3, micro_batch_size=7), packing=True,
                           fp8="" if recipe == "none" else recipe, transformer_engine=True,
                           precision="fp32" if recipe == "none" else "bf16")
    odd_losses = [t.train_step(odd, lambda lp, mb: nll_loss(lp, mb["loss_mask"]))["loss"] for t in (fp8, packed)]
    print(json.dumps({"te_spec": te, "fp8_loss_finite": math.isfinite(metrics["loss"]),
                      "mean_abs_logprob_gap": float(gap), "weights_moved": moved, "export_matches": shapes_match,
                      "odd_lengths_finite": all(map(math.isfinite, odd_losses))}))


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    main(*sys.argv[1:])
