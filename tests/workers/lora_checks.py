"""LoRA adapters on the megatron-core trainer at one layout (gloo, CPU, fp32 unless the precision is given), for
comparison with one process. Launched by the tests with torchrun (2 processes) or plainly (1).

    python tests/workers/lora_checks.py LAYOUT MODEL_DIR OUT_DIR [PRECISION] [TARGETS] [DROPOUT]

Rank 0 writes OUT_DIR/result.json: the largest gap of the logprobs with B at zero, and with the adapters switched
off, to a trainer without adapters (both exactly 0 when right); the gap made by a random B (> 0: the adapters act);
after one step, every adapter's gradient as the step's reduction left it, under its global name in one process's
layout (``helpers/lora_grads.py``: TP shards joined, pipeline stages merged; ``rank_grads``: every rank's, each
reduced over DP); before the step, with B the random one, every rank's adapters as the sync and the export gather
them (``rank_adapters``: ``lora_peft.gather_adapters``, global base layer name → [A, B] whole); what the optimizer
holds (its parameters and Adam state, in elements) against the adapters' and the base's sizes; and, in one process,
the largest gap of an adapted layer's output to the dense W x + b + (alpha / r) · B A x. TARGETS: ``lora.targets``
(default, or empty: every one); DROPOUT: ``lora.dropout`` (default 0).
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers.lora_grads import adapter_params, gathered_grads, reduced_everywhere, sharded  # noqa: E402
from helpers.processes import end_process_group  # noqa: E402
from helpers.trainers import LAYOUTS, fixed_batch, seeded_layout  # noqa: E402

RANK, ALPHA = 4, 8.0


def random_b(name: str, b: torch.Tensor, adapter) -> torch.Tensor:
    """A seeded random B drawn whole (one process's layout), this rank's part of it."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    rows = b.shape[0] * (adapter.tp if sharded(name, adapter) else 1)
    full = torch.randn(rows, b.shape[1], generator=g) * 0.05
    if rows == b.shape[0]:
        return full
    if "linear_fc1" in name:  # gate and up, each split over TP (megatron's fused fc1)
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(adapter.tp)[adapter.tp_rank], up.chunk(adapter.tp)[adapter.tp_rank]])
    return full.chunk(adapter.tp)[adapter.tp_rank]


def main(layout: str, model_dir: str, out_dir: str, precision: str = "fp32", targets: str = "",
         dropout: str = "0") -> None:
    import dataclasses

    from megarl.algo.losses import ppo_clip_loss
    from megarl.config.schema import LoraConfig, OptimConfig
    from megarl.distributed.collectives import gather
    from megarl.trainer.lora import TIED, adapters_off
    from megarl.trainer.lora_peft import gather_adapters
    from megarl.trainer.policy import PolicyTrainer

    spec = dict(LAYOUTS[layout])
    dispatcher = spec.pop("moe_dispatcher", "alltoall")
    # OptimConfig's default distributed optimizer at DP > 1 ("dp2", and "ep2_alltoall"'s dense part): its
    # reduce-scatter leaves each rank its own shard of the reduced gradients, gathered back before comparing
    # (lora_grads.reduced_everywhere); a layout's optimizer keys (if any) override
    optim = OptimConfig(lr=1e-3, micro_batch_size=2, grad_clip=0.0, logprob_chunk=8)
    keys = {f.name for f in dataclasses.fields(optim)}
    optim = dataclasses.replace(optim, **{k: spec.pop(k) for k in list(spec) if k in keys})
    ps, cfg = seeded_layout(spec, model_dir)
    common = dict(precision=precision, packing=True, moe_dispatcher=dispatcher)
    batch = fixed_batch(cfg["vocab_size"])
    frozen = PolicyTrainer(cfg, model_dir, ps, optim, trainable=False, **common)
    # a frozen model (the KL reference) keeps no gradient buffer: DDP wrapped it with nothing to train
    assert not any(b.numel for c in frozen.chunks for b in c.buffers + c.expert_parallel_buffers), "frozen grads"
    base = frozen.logprobs(batch)
    lora = LoraConfig(rank=RANK, alpha=ALPHA, dropout=float(dropout), **({"targets": targets} if targets else {}))
    trainer = PolicyTrainer(cfg, model_dir, ps, optim, lora=lora, **common)
    mask = batch.loss_mask.bool()
    result: dict = {"rank": RANK, "b_zero_gap": float((trainer.logprobs(batch) - base)[mask].abs().max())}
    adapters = adapter_params(trainer)  # (global name, local name, parameter, its adapter)
    with torch.no_grad():
        for full, _, p, adapter in adapters:
            if full.endswith(".lora.b"):  # drawn by the global name: every layout's B is one process's
                p.copy_(random_b(full, p, adapter))
    result["b_random_gap"] = float((trainer.logprobs(batch) - base)[mask].abs().max())
    gathered = gather_adapters(trainer.modules, ps, cfg)  # (a collective: every rank)
    result["rank_adapters"] = gather({k: [a.tolist(), b.tolist()] for k, (a, b) in gathered.items()})
    with adapters_off(trainer.modules):
        result["adapters_off_gap"] = float((trainer.logprobs(batch) - base)[mask].abs().max())
    if float(dropout):  # the tracker's streams the masks come from, on every rank (a digest of each state)
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        from megarl.distributed.rng import seeded_rng_state
        from megarl.trainer.lora import tie_dropout

        # the tied stream each rank's own, as a checkpoint of another layout leaves it; tied again as each RL step
        # ties it (the trainer's seed 0, step 0: the masks of the run without this)
        get_cuda_rng_tracker().states_[TIED] = seeded_rng_state(1000 + ps.rank)
        tie_dropout(trainer.adapters, 0, step=0)
        states = get_cuda_rng_tracker().get_states()
        result["streams"] = gather({k: int(states[k].double().sum()) for k in (TIED, "model-parallel-rng")})
    if ps.world_size == 1 and precision == "fp32" and not float(dropout):  # (its calls would draw masks)
        result["dense_gap"] = dense_gap(trainer)
    trainer.train_step(batch, lambda lp, mb: ppo_clip_loss(lp, mb["old_logprobs"], mb["advantages"],
                                                            mb["loss_mask"], 0.2, 0.28))
    reduced_everywhere(trainer)
    result["grads"] = gathered_grads(trainer)
    result["rank_grads"] = gather(result["grads"])  # every rank's, by global name
    chain = getattr(trainer.optimizer, "chained_optimizers", None) or [trainer.optimizer]
    held = [p for o in chain for g in o.optimizer.param_groups for p in g["params"]]
    states = [o.optimizer.state[p] for o in chain for p in held if p in o.optimizer.state]
    params = [p for _, _, p, _ in adapters]
    result.update(
        optimizer_params=sum(p.numel() for p in held),
        optimizer_main_dtypes=sorted({str(p.dtype) for p in held}),
        adam_state=sum(t.numel() for s in states for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")),
        adapter_params=sum(p.numel() for p in params),
        trainable=sum(p.numel() for m in trainer.modules for p in m.parameters() if p.requires_grad),
        base_params=sum(p.numel() for m in trainer.modules for n, p in m.named_parameters() if ".lora." not in n),
        grad_buffer=sum(b.grad_data.numel() for c in trainer.chunks for b in c.buffers + c.expert_parallel_buffers),
        base_dtypes=sorted({str(p.dtype) for m in trainer.modules for n, p in m.named_parameters()
                            if ".lora." not in n}),
    )
    os.makedirs(out_dir, exist_ok=True)
    if ps.rank == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)
    end_process_group()


def dense_gap(trainer) -> float:
    """An adapted column- and row-parallel layer (one process) against W x + b + (alpha / r) · B A x."""
    layer = trainer.modules[0].decoder.layers[0].self_attention
    gaps = []
    for linear in (x for x in (layer.linear_qkv, layer.linear_proj) if hasattr(x, "lora")):
        x = torch.randn(3, 2, linear.weight.shape[1], generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            out, bias = linear(x)
            out = out + bias if bias is not None else out
            a, b, w = linear.lora.a, linear.lora.b, linear.weight
            ref = x @ w.T + (linear.bias if linear.bias is not None else 0) + ALPHA / RANK * (x @ a.T @ b.T)
        gaps.append(float((out - ref).abs().max() / ref.abs().max()))
    return max(gaps)


if __name__ == "__main__":
    main(*sys.argv[1:])
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps({"ok": True}), flush=True)
