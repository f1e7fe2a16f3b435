"""Routing replay in the trainer at one layout, on routes a real vLLM engine captured (route_capture_checks.py).

    [torchrun --nproc-per-node 2] python tests/workers/routing_checks.py MODEL_DIR SAMPLES.pt LAYOUT

Builds the fp32 trainer at ``LAYOUT`` (tests/helpers/trainers.py) and the engine's samples as one batch with their
routes, then, with the routers' own outputs watched (a forward hook on each megatron ``TopKRouter``):

- replay: the experts every router dispatched each token to equal the engine's (the routing map's set against the
  engine's ids, every token the engine routed, every MoE layer, on every rank) in the logprob pass and in a
  training step;
- the agreement the trainer measures without replay, its logprobs with and without replay, and the gap of each to
  the engine's behaviour logprobs.

Rank 0 prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers.processes import end_process_group  # noqa: E402
from helpers.trainers import build_trainer, every_stage_routes  # noqa: E402


def load_batch(path: str):
    """The samples as one batch with their routes as one tensor, and the samples' routes (numpy arrays)."""
    from megarl.algo.batch import batch_routes, build_batch

    rows = torch.load(path, weights_only=False)
    batch = build_batch([r["prompt"] for r in rows], [r["response"] for r in rows], [r["logprobs"] for r in rows],
                        [1.0 if i % 2 else -1.0 for i in range(len(rows))])
    batch.routes = batch_routes([r["routes"] for r in rows], batch.seq_len)
    return batch, [r["routes"] for r in rows]


class Watch:
    """Counts (token, layer) pairs whose dispatched experts differ from the replay target, on this rank."""

    def __init__(self, trainer) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.checked = self.differ = 0
        for m in trainer.modules:
            for module in m.modules():
                if isinstance(module, TopKRouter):
                    module.register_forward_hook(self.hook)

    def hook(self, router, args, output) -> None:
        tap = router.router_replay
        if tap.target is None or not tap.replay:
            return
        routing_map = output[1]  # [tokens, experts] bool: where each token was dispatched
        target = tap.target
        valid = (target[:, 0] >= 0) & (target[:, 0] < routing_map.shape[1])
        wanted = torch.zeros_like(routing_map).scatter(1, target.clamp(0, routing_map.shape[1] - 1), True)
        self.checked += int(valid.sum())
        self.differ += int((routing_map != wanted).any(dim=1)[valid].sum())


def gap(logprobs, batch) -> tuple[float, float]:
    d = ((logprobs - batch.old_logprobs) * batch.loss_mask).abs()
    return float(d.sum() / batch.loss_mask.sum()), float(d.max())


def main(model_dir: str, samples: str, layout: str) -> None:
    from megarl.algo.objective import policy_loss_fn
    from megarl.config.schema import AlgoConfig, OptimConfig

    ps, cfg, trainer = build_trainer(layout, model_dir, OptimConfig(lr=1e-3, micro_batch_size=4, grad_clip=1.0))
    batch, arrays = load_batch(samples)
    watch = Watch(trainer)
    trainer.routing_replay = "none"
    own = trainer.logprobs(batch)
    agreement = dict(trainer.route_stats)
    trainer.routing_replay = "rollout"
    replayed = trainer.logprobs(batch)
    agreement_replayed = dict(trainer.route_stats)
    trainer.routing_replay = "trainer"  # R2: the trainer's own routes, recorded on every rank, replayed
    recorded, recording_pass = trainer.record_routes(batch)
    engine_routes, batch.routes = batch.routes, recorded
    r2 = trainer.logprobs(batch)
    r2_agreement = trainer.route_stats.get("moe/route_agreement")
    r2_held = recorded.nbytes()
    recorded, received = every_stage_routes(recorded.dense())  # (each rank holds its stage's layers)
    # R3 as rl_update carries it: each rank holds its share of the engine's routes, the rest fetched per pass
    trainer.routing_replay = "rollout"
    batch.routes = trainer.hold_routes(arrays, batch)
    r3_held = batch.routes.nbytes()
    # as in a run of several ranks: rank 0 alone has the samples' routes (rollout/leader.py) and sends each its share
    sent = trainer.hold_routes(arrays if dist.get_rank() == 0 else [None] * len(arrays), batch, source=0)
    same = sent.held.keys() == batch.routes.held.keys() and all(
        torch.equal(sent.held[r], batch.routes.held[r]) for r in sent.held)
    held_replayed = trainer.logprobs(batch)
    order = torch.arange(batch.size).flip(0)  # every row to another DP rank than the one holding its routes
    exchanged = trainer.logprobs(batch.select(order))
    step = trainer.train_step(batch, policy_loss_fn(AlgoConfig()))
    batch.routes = engine_routes
    fed = torch.arange(batch.seq_len)[None, :] < torch.tensor(batch.row_lengths())[:, None]  # (padding: no route)
    counts = torch.tensor([watch.checked, watch.differ], dtype=torch.float64)
    dist.all_reduce(counts)
    out = {"layout": layout, "checked": int(counts[0]), "differ": int(counts[1]),
           "agreement": agreement.get("moe/route_agreement"), "flip_tokens": agreement.get("moe/route_flip_tokens"),
           "agreement_in_replayed_pass": agreement_replayed.get("moe/route_agreement"),
           "step_agreement": step.get("moe/route_agreement"), "step_loss": step.get("loss"),
           "replay_vs_own_max": float(((replayed - own) * batch.loss_mask).abs().max()),
           "gap_own": gap(own, batch), "gap_replayed": gap(replayed, batch),
           "r2_vs_own_max": float(((r2 - own) * batch.loss_mask).abs().max()), "r2_agreement": r2_agreement,
           "r2_recording_pass_vs_replayed_max": float(((recording_pass - r2) * batch.loss_mask).abs().max()),
           "r2_routes": recorded.long().sum(dim=(0, 1, 3)).tolist(), "r2_shape": list(recorded.shape),
           "r2_unrouted": int(((recorded == 255).all(dim=-1) & fed[:, :, None]).sum()), "r2_received": received,
           "held_vs_replayed_max": float(((held_replayed - replayed) * batch.loss_mask).abs().max()),
           "exchanged_vs_replayed_max": float(((exchanged - replayed[order]) * batch.loss_mask[order]).abs().max()),
           "r2_held": [0] * dist.get_world_size(), "r3_held": [0] * dist.get_world_size(),
           "full_bytes": engine_routes.numel() * engine_routes.element_size()}
    out["sent_as_held"] = [None] * dist.get_world_size()
    dist.all_gather_object(out["sent_as_held"], same)
    dist.all_gather_object(out["r2_held"], r2_held)
    dist.all_gather_object(out["r3_held"], r3_held)
    if dist.get_rank() == 0:
        print(json.dumps(out))
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
