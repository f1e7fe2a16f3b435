"""Routing replay where a pipeline stage (or a virtual chunk) holds no MoE layer, on a Qwen2-MoE written by
transformers with some layers dense (``mlp_only_layers``).

    [torchrun --nproc-per-node 2] python tests/workers/moe_stage_checks.py MODEL_DIR LAYOUT

With the trainer at ``LAYOUT`` (tests/helpers/trainers.py): R2's recording of the trainer's own routes, a logprob
pass replaying them and a training step replaying them — each measures the routing agreement, a collective every
rank enters. Then replay's start-up self-check (``routing.check_replay_holds``): as built, with the last router's
tap taken out of its slot (what megatron's fused top-k does to every router), and under activation recompute
(which holds). Rank 0 prints one JSON line: the recorded routes (per MoE column), the logprobs with and without
replay, the agreements, what each self-check raised.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers.processes import end_process_group  # noqa: E402
from helpers.trainers import build_trainer, every_stage_routes, fixed_batch  # noqa: E402


def self_checks(trainer) -> dict:
    from megatron.core.transformer.moe.router import TopKRouter

    from megarl.trainer.routing import check_replay_holds

    def raised() -> str:
        try:
            check_replay_holds(trainer)
        except RuntimeError as exc:
            return str(exc)
        return ""

    out = {"self_check": raised()}
    routers = [m for module in trainer.modules for m in module.modules() if isinstance(m, TopKRouter)]
    if routers:  # a rank with routers: its last one's tap out of the slot (every rank runs the check)
        tap, routers[-1].router_replay = routers[-1].router_replay, None
    out["bypassed"] = raised()
    if routers:
        routers[-1].router_replay = tap
    trainer.tcfg.recompute_granularity = "full"
    out["recompute"] = raised()
    trainer.tcfg.recompute_granularity = None
    return out


def main(model_dir: str, layout: str) -> None:
    from megarl.algo.objective import policy_loss_fn
    from megarl.config.schema import AlgoConfig, OptimConfig

    ps, cfg, trainer = build_trainer(layout, model_dir, OptimConfig(lr=1e-3, micro_batch_size=4, grad_clip=1.0))
    trainer.routing_replay = "rollout"
    batch = fixed_batch(cfg["vocab_size"])
    own = trainer.logprobs(batch)
    batch.routes, _ = trainer.record_routes(batch)  # this rank's share (its rows, its stage's layers)
    replayed = trainer.logprobs(batch)  # the stages' route metrics: a pipeline collective
    agreement = trainer.route_stats.get("moe/route_agreement")
    step = trainer.train_step(batch, policy_loss_fn(AlgoConfig()))
    checks = self_checks(trainer)
    dense = batch.routes.dense()  # [rows, seq, MoE layers, k]: its DP group's rows, this rank's layers
    merged, received = every_stage_routes(dense)
    unrouted = (merged == 255).all(dim=-1)  # per (row, position, column): no expert recorded
    fed = torch.arange(batch.seq_len)[None, :] < torch.tensor(batch.row_lengths())[:, None]  # each row's own positions
    out = {"layout": layout, "stages": ps.pp, "taps": sorted(t.column for ts in trainer.taps.values() for t in ts),
           "routes_shape": list(dense.shape),
           "routes_per_column": merged.long().sum(dim=(0, 1, 3)).tolist(), "received": received,
           "unrouted_in_rows": int(unrouted[fed].sum()),
           "replay_vs_own_max": float(((replayed - own) * batch.loss_mask).abs().max()),
           "agreement": agreement, "step_agreement": step.get("moe/route_agreement"), "step_loss": step.get("loss")}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, out["taps"])
    out["taps"] = every
    out.update(checks)
    if dist.get_rank() == 0:
        print(json.dumps(out))
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
