"""MoE routing replay in megatron-core's routers, and the trainer/engine routing agreement.

megatron-core's ``TopKRouter`` asks its ``router_replay`` object for the top-k
(``moe_utils.topk_routing_with_score_function`` → ``router_replay.get_replay_topk(scores, topk, ...,
default_compute_topk)``; mcore 0.16). megatron's own ``RouterReplay`` keeps every instance in one class-wide
list (all models of the process) and its targets in a list that grows per forward; megarl puts a ``RouteTap``
of its own in each router's slot instead:

- the router's own top-k is always computed (a ``topk`` over [tokens, experts]: cheap) and, where the engine's
  routes are known, compared with them: per (token, layer) whether the two top-k *sets* agree;
- with replay on, the engine's experts are returned instead, with their scores gathered from the router's own
  (the softmax over the chosen experts and its gradient come from the trainer's logits); rows the engine never
  routed (padding, positions it skipped) carry ``types.no_route`` (no expert id) and keep the trainer's
  own choice.

Routes reach a microbatch as ``routes`` [b, s, MoE layers, k] (uint8: ``engines.routes``); a router sees its
layer's [s·b, k] rows, sequence-major as megatron flattens [s, b, h], and under sequence parallelism only this
TP rank's sequence chunk. Each router's MoE column comes from its global ``layer_number`` (1-based; pipeline
stages and virtual chunks hold their own layers).

Under activation recompute (``trainer.recompute: full``) a router runs twice per micro-batch: in the forward, inside
megatron's ``tensor_parallel.checkpoint`` (no autograd graph), and again in the backward, when the pipeline schedule
may have moved the taps on to a later micro-batch's targets (1F1B: several forwards before the first backward). The
first call keeps the experts it returned in its tap's queue; the recomputed call takes them back in the same order
(a chunk's backwards run in the order of its forwards), so it dispatches exactly as the first did, neither routing
again nor counting or recording twice (``RouteTap.get_replay_topk``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.random import is_checkpointing

from megarl.algo.batch import build_batch
from megarl.models.hf_config import is_moe_layer


def moe_columns(hf_cfg: dict, num_layers: int) -> dict[int, int]:
    """Global layer index → its column among the MoE layers (dense layers have none)."""
    cols = [i for i in range(num_layers) if is_moe_layer(hf_cfg, i)]
    return {layer: c for c, layer in enumerate(cols)}


class RouteStats:
    """Agreement counts of one pass: per (token, layer) agreement, and per token whether any layer differed."""

    def __init__(self) -> None:
        self.agree = 0.0
        self.pairs = 0.0
        self.flipped: dict[int, torch.Tensor] = {}  # microbatch → [tokens] any layer differed on this rank
        self.valid: dict[int, torch.Tensor] = {}  # microbatch → [tokens] the engine routed it
        self.microbatch = 0

    def expect(self, microbatch: int, tokens: int) -> None:
        """A microbatch of ``tokens`` router rows on this rank, flagged on every pipeline stage, MoE layers or not:
        each stage then holds the same tokens for the pipeline reduction in ``metrics``."""
        self.microbatch = microbatch
        if microbatch not in self.valid:
            self.flipped[microbatch] = torch.zeros(tokens, dtype=torch.bool)
            self.valid[microbatch] = torch.zeros(tokens, dtype=torch.bool)

    def add(self, same: torch.Tensor, valid: torch.Tensor) -> None:
        self.agree += float((same & valid).sum())
        self.pairs += float(valid.sum())
        key = self.microbatch
        differ = ~same & valid
        self.flipped[key] = differ if key not in self.flipped else self.flipped[key] | differ
        self.valid[key] = valid

    def metrics(self, pp_group=None) -> dict[str, float]:
        """``moe/route_agreement`` and ``moe/route_flip_tokens`` over every rank (a collective when
        torch.distributed runs: pipeline stages OR their tokens' flips, then every count is summed)."""
        keys = sorted(self.valid)
        flips = torch.cat([self.flipped[k] for k in keys]).float() if keys else torch.zeros(0)
        valid = torch.cat([self.valid[k] for k in keys]).float() if keys else torch.zeros(0)
        if dist.is_initialized() and pp_group is not None and dist.get_world_size(pp_group) > 1:
            # the same tokens on every stage (``expect``), a stage without MoE layers too: each enters
            both = torch.stack([flips, valid])
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=pp_group)
            flips, valid = both[0], both[1]
        totals = torch.tensor([self.agree, self.pairs, float(flips.sum()), float(valid.sum())], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(totals)  # copies of a token on several ranks cancel in the ratios
        agree, pairs, flipped, tokens = totals.tolist()
        if not pairs:
            return {}
        return {"moe/route_agreement": agree / pairs, "moe/route_flip_tokens": flipped / max(tokens, 1.0)}


class RouteTap:
    """One router's replay slot (duck-typed ``RouterReplay``)."""

    def __init__(self, column: int) -> None:
        self.column = column
        self.target: torch.Tensor | None = None  # [tokens, k] int64; rows of no expert id: not routed
        self.replay = False
        self.stats: RouteStats | None = None
        self.recorded: list[torch.Tensor] | None = None  # the router's own top-k per forward (R2)
        self.recompute: list[torch.Tensor] = []  # the experts of checkpointed forwards, for their recomputation

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if is_checkpointing() and torch.is_grad_enabled():  # the backward's recomputation: what the forward chose
            chosen = self.recompute.pop(0).to(scores.device)
            return scores.gather(1, chosen), chosen
        probs, chosen = self._route(scores, topk, num_groups, group_topk, default_compute_topk)
        if is_checkpointing():  # a forward inside megatron's checkpoint (no graph): its backward recomputes it
            self.recompute.append(chosen.detach())
        return probs, chosen

    def _route(self, scores, topk, num_groups, group_topk, default_compute_topk):
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.recorded is not None:
            self.recorded.append(own.detach().to("cpu", torch.uint8 if scores.shape[1] < 255 else torch.int16))
        target = self.target
        if target is None:
            return probs, own
        target = target.to(own.device)
        if target.shape != own.shape:
            raise RuntimeError(f"routing replay: MoE column {self.column} got routes of shape {tuple(target.shape)} "
                               f"for {tuple(own.shape)} router rows")
        valid = (target[:, 0] >= 0) & (target[:, 0] < scores.shape[1])
        if self.stats is not None:
            same = (own.sort(dim=1).values == target.sort(dim=1).values).all(dim=1)
            self.stats.add(same.cpu(), valid.cpu())
        if not self.replay:
            return probs, own
        chosen = torch.where(valid.unsqueeze(1), target, own)
        return scores.gather(1, chosen), chosen


def padding_mask(mb: dict) -> torch.Tensor | None:
    """A micro-batch's [b, s] ``padding_mask`` for megatron-core's MoE routers (True: no row's position; the
    load-balancing and z losses leave it out, routing does not change): past each row's ``lengths`` unpacked, past
    the rows laid end to end packed; None where the rows' lengths are unknown."""
    ids = mb["input_ids"]
    if "padding" in mb:  # a CP rank's chunks of a pack (algo.packing.split_for_context_parallel)
        return mb["padding"].to(ids.device)
    if "valid" in mb:  # packed (algo/packing.py): the rows, then the padding
        lengths = mb["valid"].sum().reshape(1)
    elif "lengths" in mb:
        lengths = mb["lengths"]
    else:
        return None
    return torch.arange(ids.shape[1], device=ids.device)[None, :] >= lengths.to(ids.device)[:, None]


@contextlib.contextmanager
def router_losses_off(config, off: bool):
    """The routers' load-balancing and z losses off for one forward (``off``: a micro-batch of padding alone,
    where megatron's load-balancing loss divides by its zero tokens)."""
    saved = config.moe_aux_loss_coeff, config.moe_z_loss_coeff
    if off:
        config.moe_aux_loss_coeff, config.moe_z_loss_coeff = 0.0, None
    try:
        yield
    finally:
        config.moe_aux_loss_coeff, config.moe_z_loss_coeff = saved


def attach_taps(chunk, columns: dict[int, int]) -> list[RouteTap]:
    """A ``RouteTap`` in every MoE router of one model chunk (replacing megatron's own replay slot)."""
    from megatron.core.transformer.moe.router import TopKRouter

    taps = []
    for module in chunk.modules():
        if isinstance(module, TopKRouter):
            tap = RouteTap(columns[module.layer_number - 1])
            module.router_replay = tap
            taps.append(tap)
    return taps


def set_targets(taps: list[RouteTap], routes: torch.Tensor | None, replay: bool, stats: RouteStats | None,
                tp_rank: int = 0, tp: int = 1, sequence_parallel: bool = False,
                columns: list[int] | None = None) -> None:
    """Each tap's rows of a microbatch's ``routes`` [b, s, MoE layers, k] (None: no target, own routing);
    ``columns``: the MoE columns ``routes`` holds, in order (a ``RouteStore``'s; None: every column)."""
    for tap in taps:
        tap.replay, tap.stats = replay, stats
        if routes is None:
            tap.target = None
            continue
        layer = routes[:, :, columns.index(tap.column) if columns is not None else tap.column, :]  # [b, s, k]
        if sequence_parallel and tp > 1:
            s = layer.shape[1] // tp
            layer = layer[:, tp_rank * s:(tp_rank + 1) * s]
        tap.target = layer.transpose(0, 1).reshape(-1, layer.shape[-1]).long()  # [s·b, k], sequence-major


def clear_targets(taps: list[RouteTap]) -> None:
    for tap in taps:
        tap.target, tap.replay, tap.stats = None, False, None
        tap.recompute.clear()  # (empty after a whole pass; a pass that failed half-way leaves none behind)


def recorded_rows(taps: list[RouteTap], seq_local: int) -> dict[int, torch.Tensor]:
    """What this rank's taps recorded in one forward pass, per MoE column: [rows, local sequence, k] uint8, rows in
    microbatch order; the taps stop recording."""
    out = {}
    for tap in taps:
        parts = [ids.view(seq_local, -1, ids.shape[-1]).transpose(0, 1) for ids in tap.recorded or []]
        if parts:
            out[tap.column] = torch.cat(parts)
        tap.recorded = None
    return out


def replay_blockers(config) -> list[str]:
    """What in a megatron-core ``TransformerConfig`` keeps the taps from holding the routes: the fused top-k never
    asks the router's replay slot. (Recompute does not: a recomputed router replays its first call, ``RouteTap``.)"""
    out = []
    if getattr(config, "moe_router_fusion", False):
        out.append("moe_router_fusion=True (the fused top-k bypasses the replay slot)")
    return out


def check_replay_holds(trainer) -> None:
    """Start-up self-check of routing replay on a ``PolicyTrainer``: a forward pass with one forced target per MoE
    layer (k fixed experts, the same for every token: the router's own choice differs on most) must dispatch every
    token of every router on every rank to exactly those experts; raises ``RuntimeError`` naming what bypassed the
    taps otherwise (a collective: every rank calls it)."""
    if blockers := replay_blockers(trainer.tcfg):
        raise RuntimeError(f"routing replay (algo.routing_replay={trainer.routing_replay}) cannot hold under "
                           f"megatron-core's {'; '.join(blockers)}; set algo.routing_replay=none or leave it off")
    k, experts, layers = trainer.tcfg.moe_router_topk, trainer.tcfg.num_moe_experts, len(trainer.route_columns)
    rows = max(1, trainer.ps.dp)
    batch = build_batch([[2, 3]] * rows, [list(range(4, 12))] * rows)
    forced = torch.stack([(torch.arange(k) + 1 + c) % experts for c in range(layers)])  # [layers, k]
    batch.routes = forced.to(torch.uint8 if experts < 255 else torch.int16).expand(
        rows, batch.seq_len, layers, k).clone()
    seen = torch.zeros(2, dtype=torch.float64)  # (token rows checked, rows dispatched elsewhere) on this rank

    def hook(tap: RouteTap):
        def watch(router, args, output) -> None:
            routing_map, target = output[1], tap.target
            if target is None:  # (never here: every chunk's taps get the batch's routes)
                return
            target = target.to(routing_map.device)
            valid = target[:, 0] < routing_map.shape[1]  # (rows padding the micro-batches: no target)
            wanted = torch.zeros_like(routing_map).scatter(1, target.clamp(max=routing_map.shape[1] - 1), True)
            seen[0] += float(valid.sum())
            seen[1] += float(((routing_map != wanted).any(dim=1) & valid).sum())
        return watch

    from megatron.core.transformer.moe.router import TopKRouter

    taps = iter(t for chunk_taps in trainer.taps.values() for t in chunk_taps)
    handles = [m.register_forward_hook(hook(next(taps))) for module in trainer.modules for m in module.modules()
               if isinstance(m, TopKRouter)]
    saved, trainer.routing_replay = trainer.routing_replay, "rollout"
    try:
        trainer.logprobs(batch)
    finally:
        trainer.routing_replay, trainer.route_stats = saved, {}
        for h in handles:
            h.remove()
    if dist.is_initialized():
        dist.all_reduce(seen)
    checked, wrong = seen.tolist()
    if not checked or wrong:
        raise RuntimeError(f"routing replay self-check: {int(wrong)} of {int(checked)} router rows were not "
                           f"dispatched to the forced experts (algo.routing_replay={saved}): something bypasses "
                           "megarl's route taps (trainer/routing.py); set algo.routing_replay=none")
