"""Activation recompute against none at one parallel layout (gloo, CPU), on the same weights and batch.

    python tests/workers/recompute_checks.py LAYOUT MODEL_DIR [lora]
    torchrun --nproc-per-node 2 tests/workers/recompute_checks.py pp2 MODEL_DIR

Three packed trainers at the layout from the same HF weights (``trainer.recompute`` none, selective, full; full in
units of two layers where a model chunk holds an even number, else one), two rows a micro-batch, so that a
pipeline stage runs a later micro-batch's forward before an earlier one's backward. MoE trainers replay routes given
with the batch (R3: random expert sets on most positions, none on the rest), which the trainer's own routing would
not choose: a recomputed router that routed again, or took a later micro-batch's targets, would change the
gradients. Each trainer takes one optimizer step (PPO, token mean). Rank 0 prints one JSON line: per trainer the
step's loss, grad norm and metrics, the calls of megatron's ``tensor_parallel.checkpoint`` during its step, the
largest weight gap after the step against ``none`` relative to each tensor's magnitude, and the route taps'
recompute queues left after the step (all empty: every recomputed router took its forward's experts back).

``lora``: the trainers train LoRA adapters (rank 4, dropout 0.1, every target the model has; B a seeded random one,
so A gets a gradient too) on the frozen base; the weights compared are the adapters (``lora_peft.gather_adapters``),
every trainer's step starts from the same RNG states (the dropout masks), and full recompute must redraw the
forward's masks and keep the adapters' gradients although the frozen embedding's output needs none.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers, workers
from workers.packing_checks import packing_batch  # noqa: E402

from helpers.processes import end_process_group  # noqa: E402
from helpers.trainers import LAYOUTS, relative_gap, seeded_layout  # noqa: E402

MODES = ("none", "selective", "full")


def build(layout: str, model_dir: str, lora: bool = False):
    from megarl.config.schema import LoraConfig, OptimConfig
    from megarl.models.hf_config import num_experts
    from megarl.trainer.policy import PolicyTrainer

    spec = dict(LAYOUTS[layout])
    dispatcher = spec.pop("moe_dispatcher", "alltoall")
    ps, cfg = seeded_layout(spec, model_dir)
    moe = bool(num_experts(cfg))
    chunk = cfg["num_hidden_layers"] // (ps.pp * ps.vpp)
    optim = OptimConfig(lr=1e-4, micro_batch_size=2, grad_clip=1.0, logprob_chunk=8)
    common = dict(moe_dispatcher=dispatcher, packing=True, routing_replay="rollout" if moe else "none")
    if lora:
        targets = "linear_qkv,linear_proj,experts" if moe else "linear_qkv,linear_proj,linear_fc1,linear_fc2"
        common["lora"] = LoraConfig(rank=4, alpha=8.0, dropout=0.1, targets=targets)
    trainers = {mode: PolicyTrainer(cfg, model_dir, ps, optim, recompute=mode, recompute_layers=2 - chunk % 2,
                                    **common) for mode in MODES}
    for t in trainers.values():
        with torch.no_grad():
            for i, adapter in enumerate(t.adapters):  # alike in every trainer (one layout)
                adapter.b.copy_(torch.randn(adapter.b.shape, generator=torch.Generator().manual_seed(i)) * 0.05)
    return ps, cfg, trainers


def adapters_of(trainer, ps, cfg) -> dict:
    """The trainer's adapters whole, by name (every rank's)."""
    from megarl.trainer.lora_peft import gather_adapters

    return {f"{k}.{w}": t for k, ab in gather_adapters(trainer.modules, ps, cfg).items() for w, t in zip("ab", ab)}


def counting_checkpoints() -> list[int]:
    """Count the calls of megatron's ``tensor_parallel.checkpoint`` (full: one per unit and micro-batch; selective:
    one per layer's core attention and micro-batch); the returned list's one element is the count."""
    from megatron.core import tensor_parallel

    count, original = [0], tensor_parallel.checkpoint

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    tensor_parallel.checkpoint = counted
    return count


def main(layout: str, model_dir: str, lora: str = "") -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megarl.algo.batch import aggregation_weights
    from megarl.algo.objective import policy_loss_fn
    from megarl.config.schema import AlgoConfig
    from megarl.models.hf_config import num_experts
    from megarl.weight_sync.gather import gather_full_megatron

    ps, cfg, trainers = build(layout, model_dir, lora == "lora")
    experts = num_experts(cfg)
    none = trainers["none"]
    batch, g = packing_batch(cfg["vocab_size"], experts, len(none.route_columns), cfg.get("num_experts_per_tok", 2))
    logp = none.logprobs(batch)
    batch.old_logprobs = (logp + 0.05 * torch.randn(logp.shape, generator=g)) * batch.loss_mask
    batch.weights = aggregation_weights(batch.loss_mask, "token_mean")
    held = {}
    if batch.routes is not None:  # each trainer's share of the routes, the rest fetched per pass
        arrays = [r[:n].numpy() for r, n in zip(batch.routes, batch.row_lengths())]
        held = {mode: t.hold_routes(arrays, batch) for mode, t in trainers.items()}
    count = counting_checkpoints()
    loss_fn = policy_loss_fn(AlgoConfig())
    out = {"layout": layout, "adapters": len(none.adapters),
           "world": ps.world_size, "tp": ps.tp, "pp": ps.pp, "vpp": ps.vpp, "ep": ps.ep,
           "layers_per_chunk": cfg["num_hidden_layers"] // (ps.pp * ps.vpp), "steps": {}, "checkpoints": {},
           "weight_gap": {}, "queued_after": {}, "recompute_layers": trainers["full"].tcfg.recompute_num_layers}
    rng = torch.get_rng_state(), get_cuda_rng_tracker().get_states()
    for mode, t in trainers.items():
        torch.set_rng_state(rng[0])
        get_cuda_rng_tracker().set_states(dict(rng[1]))  # (a fork writes into the dict it was given)
        count[0] = 0
        out["steps"][mode] = t.train_step(dataclasses.replace(batch, routes=held[mode]) if held else batch, loss_fn)
        out["checkpoints"][mode] = count[0]
        out["queued_after"][mode] = sum(len(tap.recompute) for taps in t.taps.values() for tap in taps)
    full = {mode: adapters_of(t, ps, cfg) if t.adapters else
            gather_full_megatron(t.modules, ps, cfg["num_hidden_layers"], experts) for mode, t in trainers.items()}
    for mode, weights in full.items():
        out["weight_gap"][mode] = relative_gap(weights, full["none"])
    if ps.rank == 0:
        print(json.dumps(out), flush=True)
    if dist.is_initialized():
        dist.barrier()
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
