"""The trainer's side of packed micro-batches (``trainer.packing``): megatron's packed-sequence parameters of a
micro-batch, its rows' outputs put back in the batch, and the routes a packed forward recorded (R2) as rows.

The micro-batches themselves are data (``megarl/algo/packing.py``): which rows, where each sits in the pack. A
packed micro-batch runs through megatron's ``thd`` path (``PackedSeqParams``; on the local layer spec
``trainer/packed_attention.py``), batch dimension 1; its logprobs (values, entropy) come back to the rows by the
same spans before the loss sees them, so every loss and metric reads rows as it does unpacked.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.algo.packing import PackedLayout
from megarl.distributed.collectives import gather
from megarl.distributed.context import gather_sequence
from megarl.types import no_route


def packed_seq_params(mb: dict, cp_group=None):
    """megatron's ``PackedSeqParams`` (``thd``) of a packed micro-batch (``algo.packing.pack``), with the rows'
    grouping the local spec's attention reads (``packed_attention.RowGroups``; TE's attention ignores it). Under
    context parallelism (``cp_group``, a micro-batch split by ``algo.packing.split_for_context_parallel``) the pack's
    ``cu_seqlens`` stay whole, its segments padded to 2·CP (also TE's ``cu_seqlens_*_padded``), and the local spec's
    attention reads this rank's chunks (``packed_attention.ContextPlan``)."""
    from megarl.trainer.packed_attention import (  # (megatron's class, subclassed)
        ContextPlan,
        RowGroups,
        RowPackedSeqParams,
    )

    cu, longest = mb["cu_seqlens"], int(mb["max_seqlen"])
    if cp_group is not None and "cp_inverse" in mb:
        return RowPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                  cu_seqlens_kv_padded=cu, max_seqlen_q=longest, max_seqlen_kv=longest,
                                  context=ContextPlan.of(cu.tolist(), cp_group))
    return RowPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                              max_seqlen_kv=longest, row_groups=RowGroups.of(cu.tolist()))


def pack_order(local: torch.Tensor, mb: dict, cp_group) -> torch.Tensor:
    """This CP rank's per-position values [1, t/cp] (logprobs, values, entropy) → the whole pack's [1, t], every CP
    rank's gathered (``distributed.context.gather_sequence``, differentiably: each position's gradient goes back to
    the rank that computed it) and put in pack order."""
    every = gather_sequence(local[0], cp_group)
    return every.index_select(0, mb["cp_inverse"].to(every.device)).unsqueeze(0)


def rows_to_batch(pieces: list[tuple[torch.Tensor, torch.Tensor]], size: int, seq_len: int) -> torch.Tensor:
    """(batch rows, their values [rows, w]) of every micro-batch → [size, seq_len] (0 where no row reached)."""
    out = torch.zeros(size, seq_len)
    for rows, values in pieces:
        if len(rows):
            out[rows, : values.shape[1]] = values.float()
    return out


def packed_rows(layouts: list[PackedLayout], pieces: list[tuple], columns: list[int], k: int, tp: int,
                dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """What this rank's route taps recorded in one packed forward pass, as its rows: batch row → [the row's
    positions, len(columns), k].

    ``layouts``: this DP rank's packed micro-batches; ``pieces``: ``(tp rank or -1 without sequence parallelism,
    {column: [per micro-batch [positions held, k]]})`` of each TP rank that recorded a part of them (under sequence
    parallelism a micro-batch's positions are split in ``tp`` equal chunks). Positions no row owns are dropped."""
    out = {row: torch.full((n, len(columns), k), no_route(dtype), dtype=dtype)
           for layout in layouts for row, n in zip(layout.rows, layout.lengths)}
    for tp_rank, recorded in pieces:
        for column, parts in recorded.items():
            c = columns.index(column)
            for layout, ids in zip(layouts, parts):
                first = 0 if tp_rank < 0 else tp_rank * (layout.padded // tp)
                for row, start, n in zip(layout.rows, layout.cu_seqlens(), layout.lengths):
                    lo, hi = max(start, first), min(start + n, first + ids.shape[0])
                    if lo < hi:
                        out[row][lo - start:hi - start, c] = ids[lo - first:hi - first]
    return out


def recorded_pieces(taps: dict, tp_rank: int, group=None) -> list[tuple]:
    """``(tp rank or -1, {column: what its taps recorded, per micro-batch})`` of this rank, or of every rank of
    ``group`` (a collective: the TP ranks that recorded a sequence chunk each); the taps stop recording."""
    columns = {}
    for chunk_taps in taps.values():
        for tap in chunk_taps:
            columns[tap.column] = list(tap.recorded or [])
            tap.recorded = None
    return gather((tp_rank, columns), group) if group is not None else [(tp_rank, columns)]


def step_metrics(out: list[dict], dp_group=None, device=None) -> dict[str, float]:
    """A step's loss (a sum over every micro-batch and DP rank) and each metric as a mean over the step's loss
    tokens: micro-batch means weighted by their ``tokens``, so the figure is the same however the rows were cut
    into micro-batches (packed or not, by rows or by tokens), and padding micro-batches count for nothing (plain
    means where no micro-batch has a token)."""
    keys = sorted(k for k in out[0] if k not in ("loss_sum", "tokens"))
    n = torch.tensor([float(o["tokens"]) for o in out], dtype=torch.float64)
    values = torch.tensor([[float(o[k]) for k in keys] for o in out], dtype=torch.float64).reshape(len(out), -1)
    totals = torch.tensor([float(n.sum()), len(out), float(sum(o["loss_sum"] for o in out))], dtype=torch.float64)
    sums = torch.cat([(values * n[:, None]).sum(0), values.sum(0), totals])
    if dp_group is not None:  # (NCCL reduces device tensors only)
        sums = sums.to(device) if device is not None else sums
        dist.all_reduce(sums, group=dp_group)
    sums = sums.cpu().tolist()
    weighted, plain, (tokens, count, loss) = sums[:len(keys)], sums[len(keys):2 * len(keys)], sums[-3:]
    metrics = {k: (w / tokens if tokens else p / count) for k, w, p in zip(keys, weighted, plain)}
    metrics["loss"] = loss
    return metrics
