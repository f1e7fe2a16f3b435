"""Packed micro-batches against unpacked rows at one parallel layout (gloo, CPU), on the same weights and batch.

    python tests/workers/packing_checks.py LAYOUT MODEL_DIR [lm|value] [fp32|bf16]
    torchrun --nproc-per-node 2 tests/workers/packing_checks.py pp2_vpp2 MODEL_DIR

Three trainers at the layout from the same HF weights: unpacked (``optim.micro_batch_size`` 2), packed by rows (2 rows
a micro-batch laid end to end: longest first, or the unpacked micro-batches under PP) and packed by tokens
(``trainer.max_tokens_per_microbatch`` = the longest row, so a row exactly as long as the budget, and rows of one
position). Each takes three optimizer steps, one per loss
aggregation (token_mean + PPO with entropy where the layout computes full logits; seq_mean_token_mean + PPO with a
k3 KL to reference logprobs; seq_mean_token_sum_norm + GSPO, per-sequence ratios); the critic (``value``) regresses
onto targets under each aggregation. MoE trainers replay routes given with the batch (R3: random expert sets on most
positions, none on the rest) and record their own (R2). Rank 0 prints one JSON line: per packed variant, the largest
logprob (value) gap relative to the largest magnitude, per step the loss, grad norm and metrics of each, the largest
weight gap after one step relative to each tensor's magnitude, R2's recorded routes compared, and the rows of the
packed-by-rows trainer's micro-batches on rank 0 (``rows_plan``; with the MoE router losses on: ``rows_plan_router``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers.processes import end_process_group  # noqa: E402
from helpers.trainers import LAYOUTS, every_stage_routes, relative_gap, seeded_layout  # noqa: E402

MAX_TOKENS = 24
"""The token budget of the packed-by-tokens trainer, and the longest row of the batch."""
STEPS = [("token_mean", dict()), ("seq_mean_token_mean", dict(kl_coef=0.1)),
         ("seq_mean_token_sum_norm", dict(policy_loss="gspo", clip_low=3e-4, clip_high=4e-4))]


def step_loss(head: str, agg: str, algo: dict):
    """One of ``STEPS``' objectives: the critic's clipped value loss, or the policy loss of ``agg`` and ``algo``."""
    from megarl.algo.losses import value_loss
    from megarl.algo.objective import policy_loss_fn
    from megarl.config.schema import AlgoConfig

    if head == "value":
        return lambda v, mb: value_loss(v, mb["old_values"], mb["returns"], mb["loss_mask"], clip=0.2)
    return policy_loss_fn(AlgoConfig(loss_agg=agg, **algo))


def packing_batch(vocab: int, experts: int = 0, layers: int = 0, k: int = 2):
    """Ten rows of 1 to ``MAX_TOKENS`` input positions (prompts of 1 to 4 tokens), random advantages; with
    ``experts``, engine routes on all but each row's last 2 positions (a distinct top-k set per position)."""
    from megarl.algo.batch import build_batch
    from megarl.types import no_route

    g = torch.Generator().manual_seed(11)
    lengths = [1, MAX_TOKENS, 3, 17, 9, 2, 12, 20, 5, 7]
    prompts, responses = [], []
    for i, n in enumerate(lengths):
        p = min(1 + i % 4, n)
        prompts.append(torch.randint(2, vocab, (p,), generator=g).tolist())
        responses.append(torch.randint(2, vocab, (n + 1 - p,), generator=g).tolist())
    adv = (torch.rand(len(lengths), generator=g) * 2 - 1).tolist()
    batch = build_batch(prompts, responses, [[-3.0] * len(r) for r in responses], adv, seq_len=MAX_TOKENS + 2)
    if experts:
        routes = torch.full((len(lengths), batch.seq_len, layers, k), no_route(torch.uint8), dtype=torch.uint8)
        for i, n in enumerate(lengths):
            for t in range(max(0, n - 2)):
                for layer in range(layers):
                    routes[i, t, layer] = torch.randperm(experts, generator=g)[:k].to(torch.uint8)
        batch.routes = routes
    return batch, g


def build(layout: str, model_dir: str, head: str, precision: str):
    from megarl.config.schema import OptimConfig
    from megarl.models.hf_config import num_experts
    from megarl.trainer.policy import PolicyTrainer

    spec = dict(LAYOUTS[layout])
    spec.pop("rows", None)
    dispatcher = spec.pop("moe_dispatcher", "alltoall")
    ps, cfg = seeded_layout(spec, model_dir)
    moe = bool(num_experts(cfg))
    # full logits (and the entropy) at one process; logprobs from hidden states in chunks elsewhere
    entropy = layout == "single" and head == "lm"
    optim = OptimConfig(lr=1e-5, micro_batch_size=2, grad_clip=1.0, logprob_chunk=8)
    common = dict(moe_dispatcher=dispatcher, head=head, precision=precision, entropy=entropy,
                  routing_replay="rollout" if moe and head == "lm" else "none")
    trainers = {
        "unpacked": PolicyTrainer(cfg, model_dir, ps, optim, **common),
        "rows": PolicyTrainer(cfg, model_dir, ps, optim, packing=True, **common),
        "tokens": PolicyTrainer(cfg, model_dir, ps, dataclasses.replace(optim, micro_batch_size=1), packing=True,
                                max_tokens_per_microbatch=MAX_TOKENS, **common),
    }
    return ps, cfg, trainers


def main(layout: str, model_dir: str, head: str = "lm", precision: str = "fp32") -> None:
    from megarl.algo.batch import aggregation_weights
    from megarl.models.hf_config import num_experts
    from megarl.weight_sync.gather import gather_full_megatron

    ps, cfg, trainers = build(layout, model_dir, head, precision)
    for t in trainers.values():  # a critic's head that is not zero (a fresh one sends the backbone no gradient)
        for m in t.modules:
            if type(getattr(m, "output_layer", None)).__name__ == "ValueHead":
                w = torch.randn(m.output_layer.weight.shape, generator=torch.Generator().manual_seed(7)) * 0.05
                m.output_layer.weight.data.copy_(w)
    experts = num_experts(cfg)
    batch, g = packing_batch(cfg["vocab_size"], experts if head == "lm" else 0,
                             len(trainers["unpacked"].route_columns), cfg.get("num_experts_per_tok", 2))
    mask = batch.loss_mask
    rows = trainers["rows"]
    plan = {"rows_plan": [mb.rows for mb in rows._plan(batch)[0]]}
    if experts:  # the plan of the same trainer with the router's load-balancing loss on
        rows.tcfg.moe_aux_loss_coeff = 0.1
        plan["rows_plan_router"] = [mb.rows for mb in rows._plan(batch)[0]]
        rows.tcfg.moe_aux_loss_coeff = 0.0
    out = {**plan, "layout": layout, "world": ps.world_size, "dp": ps.dp, "tp": ps.tp, "pp": ps.pp, "vpp": ps.vpp,
           "ep": ps.ep, "lengths": batch.lengths.tolist(), "steps": [], "logprob_gap": {}, "weight_gap": {}}

    def rel_gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(((a - b).abs() * mask).max() / (a.abs() * mask).max())

    if experts and head == "lm":  # R2: each trainer's own routes of the batch, as rows
        # (each rank holds its share: its rows, stage's layers, sequence chunk; every rank's merged)
        recorded = {name: every_stage_routes(t.record_routes(batch)[0].dense())[0] for name, t in trainers.items()}
        valid = batch.lengths.unsqueeze(1) > torch.arange(batch.seq_len)
        ref = recorded["unpacked"][valid]
        out["r2_positions"] = int(valid.sum())
        out["r2_same"] = {name: int((r[valid] == ref).all(dim=-1).all(dim=-1).sum()) for name, r in recorded.items()}
    logp = {name: t.logprobs(batch) for name, t in trainers.items()}
    out["logprob_gap"] = {name: rel_gap(logp["unpacked"], lp) for name, lp in logp.items()}
    out["logprob_mean_gap"] = {name: float(((logp["unpacked"] - lp).abs() * mask).sum() / mask.sum())
                               for name, lp in logp.items()}
    batch.old_logprobs = (logp["unpacked"] + 0.05 * torch.randn(mask.shape, generator=g)) * mask
    batch.ref_logprobs = (logp["unpacked"] + 0.1 * torch.randn(mask.shape, generator=g)) * mask
    if head == "value":
        batch.old_values = torch.zeros_like(mask)
        batch.returns = batch.advantages.clone()
    held = {}
    if batch.routes is not None:  # the steps: each trainer's share of the routes, the rest fetched per pass
        arrays = [r[:n].numpy() for r, n in zip(batch.routes, batch.row_lengths())]
        held = {name: t.hold_routes(arrays, batch) for name, t in trainers.items()}
    for agg, algo in STEPS:
        batch.weights = aggregation_weights(mask, agg, norm_tokens=MAX_TOKENS)
        loss_fn = step_loss(head, agg, algo)
        out["steps"].append({name: t.train_step(dataclasses.replace(batch, routes=held[name]) if held else batch,
                                                loss_fn) for name, t in trainers.items()})
        if len(out["steps"]) == 1:  # the weights after one step (later ones compound Adam's sign-like first steps)
            full = {name: gather_full_megatron(t.modules, ps, cfg["num_hidden_layers"], experts)
                    for name, t in trainers.items()}
            for name, weights in full.items():
                out["weight_gap"][name] = relative_gap(weights, full["unpacked"])
    if ps.rank == 0:
        print(json.dumps(out), flush=True)
    if dist.is_initialized():
        dist.barrier()
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
