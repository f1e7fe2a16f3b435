"""The routes one trainer rank holds of a batch (routing replay), and the rows a pass gives it fetched from the
ranks that hold them.

A batch's routes are [rows, positions, MoE layers, k] on no rank: each data-parallel rank holds the rows it
trains in the batch's first pass (the contiguous split of ``PolicyTrainer._local``, or its packed micro-batches'
rows), only its pipeline stage's MoE layers (what its route taps replay) and, under sequence parallelism without
packing, only its TP rank's sequence chunk (what its routers see). Mini-batches and packing give a rank other rows
later: before each pass the ranks of a DP group (one pipeline stage, one TP rank: the same layers and chunk) send
each other the rows each needs for it, point to point (``fetch``). A ``RouteStore`` is also the view a
``TrainBatch`` carries: ``select``, ``slice`` and the padding of rows and columns change which rows it names, not
what is held.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megarl.distributed.collectives import gather, share
from megarl.types import no_route


@dataclass
class RouteStore:
    """What one rank holds of a batch's routes, seen through a view of the batch's rows (``ids``, ``width``)."""

    held: dict[int, torch.Tensor]  # batch row → [positions held (to the row's end), len(columns), k]
    holder: list[int]  # batch row → the DP rank holding it
    columns: list[int]  # the MoE columns held (this rank's route taps'), ascending
    span: tuple[int, int] | None  # the positions held of every row, [first, stop) (a sequence chunk); None: all
    layers: int  # the model's MoE layers (columns)
    k: int
    dtype: torch.dtype
    ids: torch.Tensor  # this view's rows: the batch row each one is (-1: a row of padding, no route)
    width: int  # this view's positions (the batch's, or more once columns are padded)
    group: object = None  # the DP group the rows are exchanged in (None: the default group, or one process)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index) -> RouteStore:
        return replace(self, ids=self.ids[index])

    def pad_rows(self, n: int) -> RouteStore:
        return replace(self, ids=torch.cat([self.ids, torch.full((n,), -1, dtype=torch.long)]))

    def pad_columns(self, n: int) -> RouteStore:
        return replace(self, width=self.width + n)

    def nbytes(self) -> int:
        """The bytes of routes this rank holds."""
        return sum(t.numel() * t.element_size() for t in self.held.values())

    def _row(self, row: int, positions: int) -> torch.Tensor:
        out = torch.full((positions, len(self.columns), self.k), no_route(self.dtype), dtype=self.dtype)
        mine = self.held.get(row)
        if mine is not None:
            out[: min(positions, len(mine))] = mine[:positions]
        return out

    def fetch(self, device=None) -> torch.Tensor:
        """This view's rows as [rows, positions of the span, len(columns), k] (padding rows and positions past a
        row's routes: ``no_route``), the rows other DP ranks hold received from them. A collective over the DP
        group: every rank calls it at the same point, each with the rows it needs."""
        positions = self.span[1] - self.span[0] if self.span else self.width
        wanted = self.ids.tolist()
        out = torch.stack([self._row(r, positions) for r in wanted]) if wanted else torch.zeros(
            0, positions, len(self.columns), self.k, dtype=self.dtype)
        needs = gather(wanted, self.group)
        if len(needs) == 1:
            return out
        me, ranks = dist.get_rank(self.group), dist.get_process_group_ranks(self.group or dist.group.WORLD)
        ops, received = [], []
        for peer, rows in enumerate(needs):
            if peer == me:
                continue
            sent = [r for r in rows if r >= 0 and self.holder[r] == me]
            if sent:
                rows_sent = torch.stack([self._row(r, positions) for r in sent]).to(device)
                ops.append(dist.P2POp(dist.isend, as_bytes(rows_sent), ranks[peer], self.group))
            taken = [i for i, r in enumerate(wanted) if r >= 0 and self.holder[r] == peer]
            if taken:
                buf = torch.empty(len(taken), positions, len(self.columns), self.k, dtype=self.dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, as_bytes(buf), ranks[peer], self.group))
                received.append((taken, buf))
        for request in dist.batch_isend_irecv(ops) if ops else []:
            request.wait()
        for taken, buf in received:
            out[taken] = buf.cpu()
        return out

    def dense(self) -> torch.Tensor:
        """Every row of the batch as [rows, width, layers, k] with this rank's columns and sequence chunk (the
        rest: ``no_route``): what the ranks of one DP group hold together (a collective; for checks)."""
        rows = len(self.holder)
        part = replace(self, ids=torch.arange(rows)).fetch()
        out = torch.full((rows, self.width, self.layers, self.k), no_route(self.dtype), dtype=self.dtype)
        first = self.span[0] if self.span else 0
        part = part[:, : max(0, self.width - first)]
        out[:, first:first + part.shape[1], self.columns] = part
        return out


def store_of_rows(rows: dict[int, torch.Tensor], holder: list[int], columns: list[int], span: tuple[int, int] | None,
                  layers: int, k: int, dtype: torch.dtype, width: int, group=None) -> RouteStore:
    """A store of the batch rows ``rows`` (each [positions from ``span[0]``, len(columns), k]) held here."""
    return RouteStore(rows, holder, columns, span, layers, k, dtype, torch.arange(len(holder)), width, group)


def store_of_arrays(arrays: list, lengths: list[int], holder: list[int], me: int, columns: list[int],
                    span: tuple[int, int] | None, width: int, group=None) -> RouteStore | None:
    """The engine's routes of a batch's samples (each a numpy [positions, MoE layers, k], or None: not captured)
    as this DP rank's store: the rows ``holder`` gives it, its ``columns``, the positions of ``span`` (at most
    each row's ``lengths``). None when no sample has routes."""
    known = next((a for a in arrays if a is not None), None)
    if known is None:
        return None
    first, stop = span or (0, width)
    held = {}
    for row, (a, n) in enumerate(zip(arrays, lengths)):
        if holder[row] == me and a is not None:
            held[row] = torch.from_numpy(a[first:min(stop, n, len(a))][:, columns].copy())
    dtype = torch.from_numpy(known[:0]).dtype
    return store_of_rows(held, holder, columns, span, known.shape[1], known.shape[2], dtype, width, group)


def store_from_source(arrays: list, lengths: list[int], holder: list[int], me: int, columns: list[int],
                      span: tuple[int, int] | None, width: int, group=None, source: int = 0,
                      device=None) -> RouteStore | None:
    """``store_of_arrays`` where only trainer rank ``source`` has the samples' routes (the rollout leader: the
    other ranks receive the samples without them, ``rollout/leader.py``): it sends every other rank its share, its
    rows, columns and sequence chunk, point to point. A collective over every trainer rank."""
    rank = dist.get_rank()
    known = next((a for a in arrays if a is not None), None) if rank == source else None
    meta = share(None if known is None else ([len(a) if a is not None else -1 for a in arrays], known.shape[1],
                                             known.shape[2], torch.from_numpy(known[:0]).dtype), src=source)
    if meta is None:
        return None
    have, layers, k, dtype = meta
    wants = gather((me, columns, span))  # every rank's share: its DP rank, columns, positions

    def share_of(row: int, positions: tuple[int, int] | None) -> tuple[int, int]:
        first, stop = positions or (0, width)
        return first, max(first, min(stop, lengths[row], have[row]))

    if rank == source:
        for peer, (dp_rank, cols, positions) in enumerate(wants):
            parts = []
            for row, a in enumerate(arrays):
                if peer != source and holder[row] == dp_rank and a is not None:
                    first, stop = share_of(row, positions)
                    parts.append(torch.from_numpy(a[first:stop][:, cols].copy()).reshape(-1))
            if parts and sum(p.numel() for p in parts):
                dist.send(as_bytes(torch.cat(parts).to(device)), peer)
        return store_of_arrays(arrays, lengths, holder, me, columns, span, width, group)
    rows = [row for row in range(len(holder)) if holder[row] == me and have[row] >= 0]
    sizes = [share_of(row, span) for row in rows]
    counts = [(stop - first) * len(columns) * k for first, stop in sizes]
    flat = torch.empty(sum(counts), dtype=dtype, device=device)
    if flat.numel():
        dist.recv(as_bytes(flat), source)
    pieces = flat.cpu().split(counts)
    held = {row: piece.view(stop - first, len(columns), k) for row, piece, (first, stop) in zip(rows, pieces, sizes)}
    return store_of_rows(held, holder, columns, span, layers, k, dtype, width, group)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as uint8 (a view): what routes go over the wire as, since NCCL has no int16 (the expert ids of a
    model of 255 experts or more)."""
    return t.view(torch.uint8)


def row_holders(rows: int, dp: int, plan: list | None = None) -> list[int]:
    """The DP rank holding each batch row: the one training it in a pass over the whole batch (the contiguous split
    of ``PolicyTrainer._local``, or the packed ``plan``'s: every DP rank's micro-batch layouts)."""
    if plan is None:  # (the split is contiguous, in row order)
        return [dp_rank for dp_rank, part in enumerate(torch.tensor_split(torch.arange(rows), dp)) for _ in part]
    holder = [0] * rows
    for dp_rank, layouts in enumerate(plan):
        for layout in layouts:
            for row in layout.rows:
                holder[row] = dp_rank
    return holder


def sequence_chunk(seq_len: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """TP rank ``tp_rank``'s positions under sequence parallelism (the sequence padded to a multiple of ``tp``)."""
    chunk = -(-seq_len // tp)
    return tp_rank * chunk, (tp_rank + 1) * chunk


def recorded_as_rows(recorded: dict[int, torch.Tensor], rows: list[int], columns: list[int], lengths: list[int],
                     first: int, positions: int, k: int, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """An unpacked pass's recording (column → [its rows, ``positions`` from ``first``, k]) as batch row →
    [positions to the row's end, len(columns), k] (padding positions hold nothing)."""
    held = {}
    for i, row in enumerate(rows):
        n = min(positions, max(0, lengths[row] - first))
        held[row] = (torch.stack([recorded[c][i, :n] for c in columns], dim=1) if columns
                     else torch.zeros(n, 0, k, dtype=dtype))
    return held
