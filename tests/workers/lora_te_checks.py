"""LoRA adapters on Transformer Engine's layers against the same adapters on megatron-core's own (GPU, fp32).

Usage: python tests/workers/lora_te_checks.py FAMILY WORKDIR   (prints one JSON line)

One tiny model (``qwen2``: adapters on attention and the dense MLP; ``qwen3_moe``: on attention and the routed
experts, which Transformer Engine's trainer then builds as megatron's SequentialMLP, not grouped GEMMs), two LoRA
trainers from its HF weights: megatron's local spec and Transformer Engine's (fused norm+linear ``linear_qkv`` /
``linear_fc1``, whose adapters take the normed input). Every adapter's B a random one drawn by its name, alike in
both. Printed: the largest logprob gaps of the two (adapters off: the base; adapters on), the gap the adapters make,
the relative gap of every adapter's gradient after one step, and which layer classes took adapters."""

from __future__ import annotations

import json
import os
import sys

import torch


def main(family: str, work: str) -> None:
    from megarl.algo.losses import nll_loss
    from megarl.config.schema import LoraConfig, OptimConfig
    from megarl.distributed.parallel import build_parallel_state
    from megarl.models.hf_config import read_hf_config
    from megarl.models.tiny import TinyShape, make_tiny_model
    from megarl.trainer.lora import adapters_off
    from megarl.trainer.policy import PolicyTrainer

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
    from helpers.lora_grads import adapter_params
    from helpers.trainers import fixed_batch

    model = make_tiny_model(f"{work}/model", TinyShape(family=family, hidden_size=128, intermediate_size=256,
                                                       moe_intermediate_size=128))
    ps = build_parallel_state()
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    cfg = read_hf_config(model)
    batch = fixed_batch(cfg["vocab_size"], n=16, seq=32)
    batch = type(batch)(**{k: v.cuda() for k, v in batch.as_dict().items()})
    targets = "linear_qkv,linear_proj," + ("experts" if family == "qwen3_moe" else "linear_fc1,linear_fc2")
    lora = LoraConfig(rank=4, alpha=8.0, targets=targets)
    trainers = {te: PolicyTrainer(cfg, str(model), ps, OptimConfig(lr=1e-3, micro_batch_size=16), lora=lora,
                                  transformer_engine=te, precision="fp32") for te in (False, True)}
    params = {te: {full: (p, adapter) for full, _, p, adapter in adapter_params(t)} for te, t in trainers.items()}
    with torch.no_grad():
        for te in trainers:
            for full, (p, _) in params[te].items():
                if full.endswith(".lora.b"):
                    g = torch.Generator().manual_seed(sum(map(ord, full)))
                    p.copy_((torch.randn(p.shape, generator=g) * 0.05).to(p.device))
    off = {}
    for te, t in trainers.items():
        with adapters_off(t.modules):
            off[te] = t.logprobs(batch)
    on = {te: t.logprobs(batch) for te, t in trainers.items()}
    mask = batch.loss_mask.bool()
    grads = {}
    for te, t in trainers.items():
        t.train_step(batch, lambda lp, mb: nll_loss(lp, mb["loss_mask"]))
        grads[te] = {full: p.main_grad.detach().float().cpu() for full, (p, _) in params[te].items()}
    grad_gap = max(float((grads[True][k] - g).abs().max() / g.abs().max().clamp(min=1e-12))
                   for k, g in grads[False].items())
    print(json.dumps({
        "base_gap": float((off[True] - off[False])[mask].abs().max()),
        "adapted_gap": float((on[True] - on[False])[mask].abs().max()),
        "adapters_act": float((on[True] - off[True])[mask].abs().max()),
        "grad_gap": grad_gap, "same_names": sorted(grads[True]) == sorted(grads[False]), "adapters": len(grads[True]),
        "te_layers": sorted({type(m).__name__ for m in trainers[True].modules[0].modules() if hasattr(m, "lora")}),
        "te_experts": sorted({type(m).__name__ for n, m in trainers[True].modules[0].named_modules()
                              if n.endswith("mlp.experts")}),
    }))


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    main(*sys.argv[1:])
