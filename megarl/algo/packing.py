"""Packed micro-batches as data: which rows each data-parallel rank trains, in which micro-batch, end to end.

A packed micro-batch lays the input positions of several rows end to end in one sequence (batch dimension 1),
position ids restarting at 0 on each row; ``cu_seqlens`` marks where each row starts, and attention is confined to
each row (the trainer's packed attention). Padding, where a layout needs any, is a segment of its own at the end::

    rows (input positions)   a a a a | b | c c c          lengths 4, 1, 3; TP 2 with sequence parallelism
    packed, pad to 2·k       a a a a b c c c             cu_seqlens [0, 4, 5, 8]          (8: no padding)
    under PP (equal shapes)  a a a a b c c c _ _         cu_seqlens [0, 4, 5, 8, 10]      (the step's longest: 10)

Everything per token is indexed by the same spans: the trainer hands the packed logprobs (values, entropy) back to
each row's span (``unpack``), so behaviour logprobs, advantages, loss weights, masks, reference logprobs and critic
values stay one row per sequence and every loss aggregation is the unpacked one; routing-replay routes are packed
like the input ids (``pack``).

Assignment (``plan_microbatches``), computed alike on every rank from the whole batch's lengths:

- ``max_tokens`` 0: rows split over DP ranks in contiguous blocks and ``micro_batch_size`` rows per micro-batch, in
  order (the unpacked trainer's micro-batches, packed) or, ``by_length``, longest first: rows of similar length
  share a micro-batch, so its attention takes fewer, less padded groups of rows (``trainer/packed_attention.py``)
  and no micro-batch holds more positions than the unpacked trainer's (``micro_batch_size`` × the longest row);
- ``max_tokens`` M > 0: rows to DP ranks by Karmarkar–Karp on their tokens (equal loads); on each rank, the fewest
  micro-batches of ≤ M tokens that longest-first, least-loaded placement (LPT) finds; every rank then builds the
  most any rank needs (equal micro-batch counts: pipeline schedules, expert-parallel collectives), re-balanced:
  ``by_length``, as runs of its rows longest first (similar lengths together, the heaviest run as light as runs
  allow) where such runs fit in M, else by LPT (each micro-batch a mix of lengths, loads as equal as it finds).

Context parallelism (``parallel.cp`` = N; ``row_multiple`` 2·N): each row's segment is padded to a multiple of 2·N
(its padding counted in its load) and ``split_for_context_parallel`` gives each CP rank its two chunks of every
segment (``distributed/context.py``); per-row fields stay whole, so the loss reads whole rows::

    rows (input positions)   a a a a a | b              CP 2: segments of a multiple of 4
    packed                   a a a a a _ _ _ b _ _ _    cu_seqlens [0, 8, 12]
    rank 0 / rank 1          a a _ _ b _ / a a a _ _ _  chunks 0 and 3 / 1 and 2 of each segment

Invariants (tests/unit/test_packing_layout.py): every row with a position is in exactly one micro-batch; a micro-batch
holds ≤ M real tokens; every rank has the same number of micro-batches (a multiple of ``count_multiple``); each
micro-batch's length is a multiple of ``multiple`` and, with ``equal_length``, the same on every rank.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from megarl.distributed.context import chunk_positions, gathered_order
from megarl.types import no_route

MAX_TOKENS_KEY = "trainer.max_tokens_per_microbatch"


@dataclass
class PackedLayout:
    """One micro-batch: batch ``rows`` in pack order, their ``lengths`` (input positions), ``padded`` ≥ the sum of
    their segments; each row's segment is its length rounded up to ``row_multiple`` (2·CP under context
    parallelism: a row is cut into 2·CP equal chunks, ``distributed/context.py``; 1 otherwise)."""

    rows: list[int]
    lengths: list[int]
    padded: int
    row_multiple: int = 1

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def segments(self) -> list[int]:
        """Each row's positions in the pack: its length, and its padding up to ``row_multiple``."""
        return [round_up(n, self.row_multiple) for n in self.lengths]

    def cu_seqlens(self) -> list[int]:
        """Segment starts and the end; the padding after the last row, if any, is a last segment of its own."""
        out = [0]
        for n in self.segments:
            out.append(out[-1] + n)
        if self.padded > out[-1]:
            out.append(self.padded)
        return out


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def karmarkar_karp(lengths: dict[int, int], parts: int) -> list[list[int]]:
    """Rows (id → tokens) in ``parts`` sets of near-equal token sums: Karmarkar–Karp's largest differencing method
    (multiway): the two partial partitions of largest spread are merged, the heaviest set of one with the lightest
    of the other, until one partition is left. Deterministic (ties by row id)."""
    heap = []
    for row, n in sorted(lengths.items()):
        sets = [(n, [row])] + [(0, []) for _ in range(parts - 1)]
        heapq.heappush(heap, (-n, row, sets))
    if not heap:
        return [[] for _ in range(parts)]
    while len(heap) > 1:
        _, key_a, a = heapq.heappop(heap)
        _, key_b, b = heapq.heappop(heap)
        a = sorted(a, key=lambda s: (s[0], s[1]))
        b = sorted(b, key=lambda s: (-s[0], s[1]))
        merged = sorted(((x[0] + y[0], x[1] + y[1]) for x, y in zip(a, b)), key=lambda s: (s[0], s[1]))
        heapq.heappush(heap, (-(merged[-1][0] - merged[0][0]), min(key_a, key_b), merged))
    return [sorted(rows) for _, rows in heap[0][2]]


def _longest_first(rows: list[int], lengths: dict[int, int]) -> list[int]:
    """``rows`` by length, longest first, ties by row id (deterministic on every rank)."""
    return sorted(rows, key=lambda r: (-lengths[r], r))


def _lpt(rows: list[int], lengths: dict[int, int], bins: int, cap: int) -> list[list[int]] | None:
    """Longest first, each into the least-loaded bin; None when a row fits in no bin (≤ ``cap`` tokens)."""
    load, out = [0] * bins, [[] for _ in range(bins)]
    for row in _longest_first(rows, lengths):
        j = min(range(bins), key=lambda b: (load[b], b))
        if load[j] + lengths[row] > cap:
            return None
        load[j] += lengths[row]
        out[j].append(row)
    return out


def _runs(rows: list[int], lengths: dict[int, int], bins: int, cap: int) -> list[list[int]] | None:
    """Rows longest first, cut into ``bins`` runs of ≤ ``cap`` tokens each, the heaviest run as light as a cut
    allows (the least limit for which cutting greedily takes ``bins`` runs or fewer); None when no cut gives
    exactly ``bins`` runs within the cap."""
    order = _longest_first(rows, lengths)

    def cut(limit: int) -> list[list[int]]:
        out, load = [[]], 0
        for r in order:
            if out[-1] and load + lengths[r] > limit:
                out, load = out + [[]], 0
            out[-1].append(r)
            load += lengths[r]
        return out

    if not order or len(cut(cap)) > bins:
        return None
    low, high = max(-(-sum(lengths[r] for r in order) // bins), lengths[order[0]]), cap
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if len(cut(mid)) <= bins else (mid + 1, high)
    out = cut(low)
    return out if len(out) == bins else None


def _split_to(bins: list[list[int]], lengths: dict[int, int], count: int) -> list[list[int]]:
    """``bins`` (each ≤ the cap) split until there are ``count``: the heaviest bin of ≥ 2 rows in two by LPT; empty
    bins when every bin holds one row (such a rank's extra micro-batches are padding only)."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        many = [b for b in bins if len(b) > 1]
        if not many:
            bins.append([])
            continue
        heavy = max(many, key=lambda b: (sum(lengths[r] for r in b), -min(b)))
        bins.remove(heavy)
        bins.extend(_lpt(heavy, lengths, 2, sum(lengths[r] for r in heavy)))
    return bins


def _token_bins(rows: list[int], lengths: dict[int, int], cap: int) -> list[list[int]]:
    """The fewest LPT bins of ≤ ``cap`` tokens (at least one)."""
    bins = max(1, -(-sum(lengths[r] for r in rows) // cap))
    while (out := _lpt(rows, lengths, bins, cap)) is None:
        bins += 1
    return out


def plan_microbatches(lengths: list[int], dp: int = 1, micro_batch_size: int = 1, max_tokens: int = 0,
                      multiple: int = 1, equal_length: bool = False,
                      count_multiple: int = 1, by_length: bool = False,
                      row_multiple: int = 1) -> list[list[PackedLayout]]:
    """Per data-parallel rank, its packed micro-batches (see the module docstring). Rows of length 0 carry no
    position and are left out; a row longer than ``max_tokens`` raises, naming the key. ``row_multiple``: each row
    padded to a multiple of it (2·CP under context parallelism), its padding counted in its load and the budget."""
    real = {i: int(n) for i, n in enumerate(lengths) if n > 0}
    known = {i: round_up(n, row_multiple) for i, n in real.items()}
    if max_tokens:
        if too_long := [i for i, n in known.items() if n > max_tokens]:
            i = too_long[0]
            padded = f" ({known[i]} padded to a multiple of {row_multiple})" if row_multiple > 1 else ""
            raise ValueError(f"{MAX_TOKENS_KEY}={max_tokens} is less than row {i}'s {real[i]} positions{padded} "
                             f"({len(too_long)} rows longer): raise it to at least {max(known.values())}")
        ranks = karmarkar_karp(known, dp)
        per_rank = [_token_bins(rows, known, max_tokens) for rows in ranks]
        count = max(len(b) for b in per_rank)
        count = -(-count // count_multiple) * count_multiple
        per_rank = [((by_length and _runs(rows, known, count, max_tokens)) or _lpt(rows, known, count, max_tokens)
                     or _split_to(bins, known, count)) for rows, bins in zip(ranks, per_rank)]
        per_rank = [sorted(bins, key=lambda b: min(b) if b else len(lengths)) for bins in per_rank]
    else:
        blocks = torch.tensor_split(torch.arange(len(lengths)), dp)
        per_rank = []
        for block in blocks:
            rows = [int(r) for r in block if int(r) in known]
            if by_length:
                rows = _longest_first(rows, known)
            per_rank.append([rows[i:i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)])
        count = max(1, max(len(b) for b in per_rank))
        count = -(-count // count_multiple) * count_multiple
        per_rank = [bins + [[] for _ in range(count - len(bins))] for bins in per_rank]

    def rounded(n: int) -> int:
        return max(multiple, round_up(n, multiple))

    longest = max(rounded(sum(known[r] for r in b)) for bins in per_rank for b in bins)
    return [[PackedLayout(b, [real[r] for r in b], longest if equal_length else rounded(sum(known[r] for r in b)),
                          row_multiple) for b in bins] for bins in per_rank]


ROW_FIELDS_SKIPPED = ("input_ids", "position_ids", "labels", "routes", "lengths")
"""TrainBatch fields that are packed (or only describe the rows), not handed on row by row."""


def pack(fields: dict[str, torch.Tensor], layout: PackedLayout, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """One packed micro-batch from a batch's tensors (``TrainBatch.as_dict()``).

    Packed, [1, padded]: ``input_ids``, ``position_ids`` (restarting at each row), ``labels``, and ``routes``
    [1, padded, MoE layers, k] (padding: no expert id); ``cu_seqlens`` int32 and ``max_seqlen`` (a 0-dim tensor).
    Per row, [rows, w] with w the micro-batch's longest row: every other per-token field, and ``gather`` (each
    (row, position)'s index in the pack; 0 past the row's end) with ``valid`` (inside the row). ``rows``: their
    indices in the batch."""
    rows, lengths = layout.rows, layout.lengths
    width = max(lengths, default=0)
    index = torch.tensor(rows, dtype=torch.long)
    cu = layout.cu_seqlens()
    starts = cu[: len(rows)]
    segments = [end - start for start, end in zip(cu[:-1], cu[1:])]  # rows (to their multiple), then any padding

    out = {
        "input_ids": pack_rows(fields["input_ids"], layout, pad_id),
        "labels": pack_rows(fields["labels"], layout, pad_id),
        "position_ids": torch.cat([torch.arange(n) for n in segments]).unsqueeze(0),
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "max_seqlen": torch.tensor(max(segments, default=0)),
        "rows": index,
    }
    if torch.is_tensor(fields.get("routes")):  # (a ``RouteStore``'s rows: the trainer packs them, ``pack_rows``)
        out["routes"] = pack_rows(fields["routes"], layout, no_route(fields["routes"].dtype))
    cols = torch.arange(width)
    valid = cols.unsqueeze(0) < torch.tensor(lengths, dtype=torch.long).unsqueeze(1)
    out["valid"] = valid
    out["gather"] = torch.where(valid, torch.tensor(starts, dtype=torch.long).unsqueeze(1) + cols, 0)
    for key, value in fields.items():
        if key not in ROW_FIELDS_SKIPPED:
            out[key] = value[index, :width]
    return out


def pack_rows(values, layout: PackedLayout, fill) -> torch.Tensor:
    """Per-row values (a [rows, positions, ...] tensor, or a mapping of batch row → [positions, ...]) laid end to end
    as one micro-batch's [1, padded, ...], each row cut at its length, the padding (after each row to its segment's
    end, and after the last) ``fill``."""
    parts = [values[r][:n] for r, n in zip(layout.rows, layout.lengths)]
    shape, dtype = (parts[0].shape[1:], parts[0].dtype) if parts else (values.shape[2:], values.dtype)
    if layout.row_multiple > 1:  # each row's own padding, up to its segment's end
        parts = [p for part, n in zip(parts, layout.segments)
                 for p in (part, torch.full((n - len(part), *shape), fill, dtype=dtype))]
    parts.append(torch.full((layout.padded - sum(layout.segments), *shape), fill, dtype=dtype))
    return torch.cat(parts).unsqueeze(0)


PER_POSITION = ("input_ids", "labels", "position_ids", "routes")
"""A packed micro-batch's fields the model reads position by position: each CP rank takes its chunks of them."""


def split_for_context_parallel(mb: dict, cp: int, rank: int) -> dict:
    """CP rank ``rank``'s share of a packed micro-batch (``pack``, segments of a multiple of 2·CP:
    ``plan_microbatches(row_multiple=2·cp)``): ``input_ids``, ``labels`` (shifted in the pack's order before the
    cut), ``position_ids`` (positions in their row) and ``routes`` [1, t/cp, ...], chunks ``rank`` and
    2·CP−1−``rank`` of every segment (``distributed/context.py``). Whole as packed: ``cu_seqlens``, ``max_seqlen``
    and every per-row field (the loss reads whole rows: the trainer gathers the pack's logprobs over CP first).
    Added: ``cp_inverse`` (each pack position's index among the CP ranks' local packs laid end to end),
    ``cp_own`` [rows, w] (the row positions this rank computes: its share of every per-token sum) and ``padding``
    [1, t/cp] (positions no row owns, for the MoE routers' losses)."""
    index, _ = chunk_positions(mb["cu_seqlens"], cp, rank)
    out = dict(mb)
    for key in PER_POSITION:
        if key in mb:
            out[key] = mb[key][:, index]
    held = torch.zeros(int(mb["cu_seqlens"][-1]), dtype=torch.bool)
    held[index] = True
    real = torch.zeros_like(held)
    real[mb["gather"][mb["valid"]]] = True
    out["cp_inverse"] = gathered_order(mb["cu_seqlens"], cp)
    out["cp_own"] = held[mb["gather"]] & mb["valid"]
    out["padding"] = ~real[index].unsqueeze(0)
    return out


def unpack(values: torch.Tensor, mb: dict) -> torch.Tensor:
    """Packed per-position values [1, padded] (logprobs, values, entropy) → [rows, w] of the micro-batch's rows
    (0 past each row's end), differentiably."""
    return torch.where(mb["valid"], values[0][mb["gather"]], 0.0)
