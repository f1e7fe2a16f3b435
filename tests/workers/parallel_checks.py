"""One parallel layout of the megatron-core trainer on a fixed batch (gloo, CPU), for comparison
with the single-process run. Launched by the tests with torchrun (2 processes) or plainly (1).

    python tests/workers/parallel_checks.py LAYOUT MODEL_DIR OUT_DIR [lm|value]
    torchrun --nproc-per-node 2 tests/workers/parallel_checks.py ep2_alltoall MODEL_DIR OUT_DIR

The last pipeline stage of data-parallel rank 0 writes OUT_DIR/result.json (loss, logprobs of the
whole batch, gathered from every data-parallel rank) and rank 0 OUT_DIR/weights.pt (the full model
after one optimizer step). The same script serves the critic check.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers.processes import end_process_group  # noqa: E402
from helpers.trainers import LAYOUTS, build_trainer, fixed_batch  # noqa: E402


def main(layout: str, model_dir: str, out_dir: str, head: str = "lm") -> None:
    from megarl.algo.losses import ppo_clip_loss, value_loss
    from megarl.config.schema import OptimConfig
    from megarl.models.hf_config import num_experts
    from megarl.trainer import model as trainer_model
    from megarl.weight_sync.gather import gather_full_megatron

    ps, cfg, trainer = build_trainer(layout, model_dir, OptimConfig(lr=1e-5, micro_batch_size=2, grad_clip=1.0),
                                     head)
    batch = fixed_batch(cfg["vocab_size"], n=LAYOUTS[layout].get("rows", 8))
    if head == "value":  # the critic regresses onto fixed targets
        batch.old_values = torch.zeros_like(batch.loss_mask)
        batch.returns = batch.advantages.clone()
        # a head that is not zero (as after the critic's first step): the zero head of a fresh critic sends the
        # backbone no gradient, which hid a TP× backbone gradient under sequence parallelism
        for m in trainer.modules:
            if type(getattr(m, "output_layer", None)).__name__ == "ValueHead":
                g = torch.Generator().manual_seed(7)
                m.output_layer.weight.data.copy_(torch.randn(m.output_layer.weight.shape, generator=g) * 0.05)
    logp = trainer.logprobs(batch)

    def loss(lp, mb):
        if head == "value":
            return value_loss(lp, mb["old_values"], mb["returns"], mb["loss_mask"], clip=0.0)
        return ppo_clip_loss(lp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"], 0.2, 0.28)

    metrics = trainer.train_step(batch, loss)
    full = gather_full_megatron(trainer.modules, ps, cfg["num_hidden_layers"], num_experts(cfg))
    norms = [metrics["grad_norm"]] * ps.world_size  # every rank's (its clipping uses it): all must agree
    if ps.world_size > 1:
        dist.all_gather_object(norms, metrics["grad_norm"])
    os.makedirs(out_dir, exist_ok=True)
    if ps.rank == 0:
        torch.save({k: v.float() for k, v in full.items()}, os.path.join(out_dir, "weights.pt"))
    if ps.is_last_stage and ps.dp_rank == 0 and ps.tp_rank == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({"layout": layout, "head": head, "loss": metrics.get("loss"), "grad_norm": metrics["grad_norm"],
                       "metrics": metrics,
                       "logprobs": logp.tolist(), "mask": batch.loss_mask.tolist(), "world": ps.world_size,
                       "dp": ps.dp, "tp": ps.tp, "pp": ps.pp, "ep": ps.ep, "etp": ps.etp,
                       "dispatcher": trainer.tcfg.moe_token_dispatcher_type, "said": sorted(trainer_model._SAID),
                       "grad_norms": norms}, f)
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps({"ok": True}), flush=True)
