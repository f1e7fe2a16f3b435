"""The policy trainer's side of routing replay's routes (``PolicyTrainer`` inherits it): what a rank holds of a
batch's routes (the engine's, R3) and its own routes recorded in one pass (R2), as ``RouteStore``s
(``route_store.py``: the rows, layers and sequence chunk a rank trains)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.trainer.packed import packed_rows, recorded_pieces
from megarl.trainer.route_store import (
    RouteStore,
    recorded_as_rows,
    row_holders,
    sequence_chunk,
    store_from_source,
    store_of_arrays,
    store_of_rows,
)
from megarl.trainer.routing import recorded_rows
from megarl.types import TrainBatch


class RouteRecording:
    """Route methods over a ``PolicyTrainer``'s state (``ps``, ``taps``, ``held_columns``, ``route_columns``,
    ``packing``, ``tcfg``, ``device``) and passes (``_plan``, ``_local``, ``logprobs``, ``_watched``)."""

    def _holders(self, batch: TrainBatch) -> list[int]:
        """The DP rank that trains each row of ``batch`` in a pass over the whole batch: where its routes are held."""
        return row_holders(batch.size, self.ps.dp, self._plan(batch) if self.packing else None)

    def _route_span(self, batch: TrainBatch) -> tuple[int, int] | None:
        """This TP rank's sequence chunk under sequence parallelism without packing (what its routers see; ``_local``
        pads the batch to a multiple of TP), else None (every position)."""
        if not self.ps.sequence_parallel or self.ps.tp == 1 or self.packing:
            return None
        return sequence_chunk(batch.seq_len, self.ps.tp, self.ps.tp_rank)

    def hold_routes(self, arrays: list, batch: TrainBatch, source: int | None = None) -> RouteStore | None:
        """The engine's routes of ``batch``'s samples (each [positions, MoE layers, k], or None) as this rank holds
        them (``RouteStore``): the rows it trains in a pass over the whole batch, its stage's layers, its sequence
        chunk; None without routes or route taps. ``source``: the one rank whose samples carry routes, which sends
        each rank its share (a collective; every rank's ``arrays`` otherwise)."""
        if not self.taps:
            return None
        args = (batch.row_lengths(), self._holders(batch), self.ps.dp_rank, self.held_columns,
                self._route_span(batch), batch.seq_len, self.ps.dp_group)
        if source is not None and dist.is_initialized() and dist.get_world_size() > 1:
            return store_from_source(arrays, *args, source=source, device=self.device)
        return store_of_arrays(arrays, *args)

    def record_routes(self, batch: TrainBatch) -> tuple[RouteStore, torch.Tensor]:
        """R2 (``algo.routing_replay: trainer``): this policy's own routes of ``batch`` in one forward pass, as
        this rank holds them (``RouteStore``: the rows it recorded, its stage's layers, its sequence chunk), and
        that pass's logprobs [N, T] (what a pass replaying those routes computes: the caller's to reuse)."""
        with self._watched("route recording"):
            return self._record_routes(batch)

    def _record_routes(self, batch: TrainBatch) -> tuple[RouteStore, torch.Tensor]:
        if self.ps.cp > 1:  # (config.validate refuses it first: each CP rank's taps see its chunks of the rows only)
            raise NotImplementedError(f"algo.routing_replay=trainer (R2) at parallel.cp={self.ps.cp}")
        taps = [t for chunk_taps in self.taps.values() for t in chunk_taps]
        for tap in taps:
            tap.recorded = []
        saved, self.routing_replay = self.routing_replay, "none"
        try:  # (the engine's routes, where the batch has them, only measured against: ``route_stats``)
            logprobs = self.logprobs(batch)
        finally:
            self.routing_replay = saved
        k, split = self.tcfg.moe_router_topk, self.ps.sequence_parallel and self.ps.tp > 1
        dtype, columns = torch.uint8 if self.tcfg.num_moe_experts < 255 else torch.int16, self.held_columns
        span = self._route_span(batch)
        if self.packing:  # each packed micro-batch's routes, back in rows (a TP rank's chunks joined under SP)
            pieces = recorded_pieces(self.taps, self.ps.tp_rank if split else -1, self.ps.tp_group if split else None)
            held = packed_rows(self._plan(batch)[self.ps.dp_rank], pieces, columns, k, self.ps.tp, dtype)
        else:  # this rank recorded its rows of ``_local``, its sequence chunk under SP: what it holds
            local = self._local(batch)
            seq_local, recorded = local.seq_len // self.ps.tp if split else local.seq_len, {}
            for chunk_taps in self.taps.values():
                recorded.update(recorded_rows(chunk_taps, seq_local))
            rows = torch.tensor_split(torch.arange(batch.size), self.ps.dp)[self.ps.dp_rank].tolist()
            held = recorded_as_rows(recorded, rows, columns, batch.row_lengths(), span[0] if span else 0, seq_local,
                                    k, dtype)
        store = store_of_rows(held, self._holders(batch), columns, span, len(self.route_columns), k, dtype,
                              batch.seq_len, self.ps.dp_group)
        return store, logprobs
