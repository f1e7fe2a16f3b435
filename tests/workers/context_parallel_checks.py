"""Packed micro-batches at one layout, for comparison across layouts: context parallelism (``parallel.cp``) against
one process (gloo, CPU), on the same weights and batch.

    python tests/workers/context_parallel_checks.py single MODEL_DIR OUT [lm|value] [full|chunk] [local|te] [fp32|bf16]
    torchrun --nproc-per-node 2 tests/workers/context_parallel_checks.py cp2 MODEL_DIR OUT

One packed trainer (by tokens: ``trainer.max_tokens_per_microbatch`` 24, the longest row; rows of 1 to 24 positions,
so rows shorter than 2·CP) takes three optimizer steps, one per loss aggregation (token_mean + PPO, with the entropy
where it computes full logits; seq_mean_token_mean + PPO with a k3 KL; seq_mean_token_sum_norm + GSPO, whose ratio is
a whole row's); the critic (``value``) regresses onto targets. MoE trainers replay routes given with the batch (R3).
Rank 0 saves to OUT (``torch.save``): the logprobs (values) of the batch before any step, each step's metrics (loss,
grad norm, ...) and every full weight after the first step; and prints one JSON line with the layout.
``chunk``: logprobs from hidden states in chunks of 8 positions (``optim.logprob_chunk``) instead of full logits;
``te``: Transformer Engine's layer spec (GPUs: its attention does CP itself); ``bf16``: the trainer's precision.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers, workers
from workers.packing_checks import MAX_TOKENS, STEPS, packing_batch, step_loss  # noqa: E402

from helpers.processes import end_process_group  # noqa: E402
from helpers.trainers import LAYOUTS, seeded_layout  # noqa: E402


def main(layout: str, model_dir: str, out_path: str, head: str = "lm", logprobs: str = "full", spec: str = "local",
         precision: str = "fp32") -> None:
    from megarl.algo.batch import aggregation_weights
    from megarl.config.schema import OptimConfig
    from megarl.models.hf_config import num_experts
    from megarl.trainer.policy import PolicyTrainer
    from megarl.weight_sync.gather import gather_full_megatron

    spec = dict(LAYOUTS[layout])
    dispatcher = spec.pop("moe_dispatcher", "alltoall")
    ps, cfg = seeded_layout(spec, model_dir)
    experts = num_experts(cfg)
    chunked = logprobs == "chunk"
    optim = OptimConfig(lr=1e-5, micro_batch_size=1, grad_clip=1.0, logprob_chunk=8 if chunked else 0)
    trainer = PolicyTrainer(cfg, model_dir, ps, optim, moe_dispatcher=dispatcher, head=head,
                            entropy=head == "lm" and not chunked, packing=True, max_tokens_per_microbatch=MAX_TOKENS,
                            transformer_engine=spec == "te", precision=precision,
                            routing_replay="rollout" if experts and head == "lm" else "none")
    for m in trainer.modules:  # a critic's head that is not zero (a fresh one sends the backbone no gradient)
        if type(getattr(m, "output_layer", None)).__name__ == "ValueHead":
            m.output_layer.weight.data.copy_(torch.randn(m.output_layer.weight.shape,
                                                         generator=torch.Generator().manual_seed(7)) * 0.05)
    batch, g = packing_batch(cfg["vocab_size"], experts if head == "lm" else 0, len(trainer.route_columns),
                             cfg.get("num_experts_per_tok", 2))
    mask = batch.loss_mask
    held = None
    if batch.routes is not None:  # this rank's share of the engine's routes (R3), the rest fetched per pass
        held = trainer.hold_routes([r[:n].numpy() for r, n in zip(batch.routes, batch.row_lengths())], batch)
        batch = dataclasses.replace(batch, routes=held)
    logp = trainer.logprobs(batch)
    batch.old_logprobs = (logp + 0.05 * torch.randn(mask.shape, generator=g)) * mask
    batch.ref_logprobs = (logp + 0.1 * torch.randn(mask.shape, generator=g)) * mask
    if head == "value":
        batch.old_values = torch.zeros_like(mask)
        batch.returns = batch.advantages.clone()
    steps, weights = [], {}
    for agg, algo in STEPS:
        batch.weights = aggregation_weights(mask, agg, norm_tokens=MAX_TOKENS)
        steps.append(trainer.train_step(batch, step_loss(head, agg, algo)))
        if len(steps) == 1:  # the weights after one step (later ones compound Adam's sign-like first steps)
            weights = gather_full_megatron(trainer.modules, ps, cfg["num_hidden_layers"], experts)
    plan = [[mb.rows for mb in rank] for rank in trainer._plan(batch)]
    if ps.rank == 0:
        torch.save({"logprobs": logp * mask, "mask": mask, "steps": steps,
                    "weights": {k: v.float().clone() for k, v in weights.items()}}, out_path)
        print(json.dumps({"layout": layout, "world": ps.world_size, "cp": ps.cp, "dp": ps.dp, "tp": ps.tp,
                          "ep": ps.ep, "plan": plan, "lengths": batch.lengths.tolist(),
                          "route_agreement": steps[0].get("moe/route_agreement")}), flush=True)
    if dist.is_initialized():
        dist.barrier()
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
