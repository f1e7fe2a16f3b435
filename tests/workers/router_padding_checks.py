"""The MoE routers' load-balancing and z losses on padded batches (megatron-core's ``padding_mask``).

    python tests/workers/router_padding_checks.py MODEL_DIR LAYOUT Z_LOSS_COEFF

With the trainer at ``LAYOUT`` (tests/helpers/trainers.py; the load-balancing loss on, the z loss at
``Z_LOSS_COEFF``), one optimizer step each on:
a fixed batch; the same rows with 12 more padding positions; the same rows with 4 padding rows (a micro-batch of
padding only). Prints the routers' gradients' largest difference between the first two (the padding counted in
the router losses moves them), their scale, and whether the third step stayed finite.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers.processes import end_process_group  # noqa: E402
from helpers.trainers import build_trainer, fixed_batch  # noqa: E402


def router_grads(trainer) -> dict[str, torch.Tensor]:
    return {name: p.main_grad.detach().clone() for c in trainer.chunks for name, p in c.named_parameters()
            if name.endswith("mlp.router.weight")}


def main(model_dir: str, layout: str, z_loss: str) -> None:
    from megarl.algo.objective import policy_loss_fn
    from megarl.config.schema import AlgoConfig, OptimConfig

    optim = OptimConfig(lr=0.0, micro_batch_size=4, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=float(z_loss))
    _, cfg, trainer = build_trainer(layout, model_dir, optim)
    batch, loss = fixed_batch(cfg["vocab_size"]), policy_loss_fn(AlgoConfig())
    grads = []
    for b in (batch, batch.pad_columns(12), batch.pad_rows(4)):
        step = trainer.train_step(b, loss)
        grads.append((router_grads(trainer), step))
    (plain, _), (wide, _), (rows, rows_step) = grads
    diff = max(float((plain[k] - wide[k]).abs().max()) for k in plain)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    print(json.dumps({"routers": len(plain), "padded_vs_plain_max": diff,
                      "scale": max(float(g.abs().max()) for g in plain.values()),
                      "padding_rows_finite": all(bool(torch.isfinite(g).all()) for g in rows.values()),
                      "padding_rows_skipped": rows_step["skipped"]}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
    end_process_group()
