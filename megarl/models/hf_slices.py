"""One rank's shard of an HF checkpoint, read from the safetensors files slice by slice.

A trainer rank holds a shard of each of its parameters (``sharding.py``'s rules: TP rows or columns, PP layers,
EP experts, expert TP). ``ShardReader.plan`` says, from the safetensors headers alone, which rows (and columns) of
which HF tensors make that shard, and ``read`` reads exactly those bytes (``HFCheckpoint.read_rows``) into the
parameter itself, so a rank never holds a tensor it does not own: at most one block of ``block_bytes`` is in flight
(a column split, or a cast from the file's dtype). The result is bit for bit ``shard_for_rank(hf_to_megatron(all
tensors))``, which loaded every tensor of every file on every rank.

How a shard is found (names from the adapter's maps, ``hf_adapter.hf_parts``):

- the parameter's local name → its global one (``sharding.global_name``: the chunk's layers, this EP rank's experts;
  Transformer Engine's grouped-GEMM expert names through ``local_expert_name``, its fused norms through the
  adapter's map);
- the fused tensor's rows are split as ``torch.chunk`` splits them (``sharding.tp_split_dim``), by the TP rank, or
  by the expert-TP rank for routed experts; each kept row comes from one HF tensor:

  - ``linear_qkv`` (weight, bias): fused row ``r`` is row ``r mod G`` of query group ``r // G`` (``G`` = (heads/kv
    + 2)·head_dim: its q heads, then k, then v), so a rank's rows are, group by group, a row range of q, of k and
    of v, each read straight into its place;
  - ``linear_fc1`` = [gate; up], each split by rank: this rank's rows of gate, then of up;
  - ``linear_proj``, ``linear_fc2`` (split by columns): the tensor's rows in blocks, this rank's columns of each;
  - anything else: the whole tensor, or the embedding's and output layer's vocab rows.

Worked example (Qwen3-style attention, 4 query heads, 2 kv heads, head_dim 2, TP 2): G = (2 + 2)·2 = 8 fused rows
per group; TP rank 1 holds fused rows [8, 16), all of group 1: q rows [4, 8), k rows [2, 4), v rows [2, 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.models.hf_adapter import head_layout, hf_parts
from megarl.models.hf_config import num_experts
from megarl.models.hf_reader import HFCheckpoint
from megarl.models.sharding import RankCoords, global_name, local_expert_name, tp_split_dim


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of the HF tensor ``name`` (only columns ``[columns[0], columns[1])`` of them when
    given), placed at row ``at`` of the slice."""

    name: str
    start: int
    stop: int
    at: int
    columns: tuple[int, int] | None = None


@dataclass(frozen=True)
class SlicePlan:
    """One parameter's shard: its shape, the dtype of its HF source, and the pieces that fill it, row ranges in
    order."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]


def chunk_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """The range ``torch.chunk(range(n), size)[rank]`` covers (chunks of ceil(n / size); the last ones may be short,
    or empty)."""
    step = -(-n // size)
    return min(rank * step, n), min((rank + 1) * step, n)


class ShardReader:
    """Plans and reads a rank's shards of the HF checkpoint in ``model_dir`` (its config ``cfg``).

    ``block_bytes``: the most a piece holds in memory besides its destination, where it cannot be read in place
    (a column split, or a destination of another dtype than the file's)."""

    def __init__(self, model_dir: str | Path, cfg: dict, block_bytes: int = 16 << 20) -> None:
        self.files = HFCheckpoint(model_dir)
        self.cfg, self.block_bytes = cfg, block_bytes
        self.layers, self.experts = cfg["num_hidden_layers"], num_experts(cfg)

    def plan(self, param: str, c: RankCoords) -> SlicePlan | None:
        """What the parameter ``param`` (a local name of the model chunk at ``c``) holds, or None when the checkpoint
        has no tensor for it."""
        local = local_expert_name(param)
        name = global_name(local, self.layers, self.experts, c)
        try:
            kind, parts = hf_parts(name, self.cfg)
        except KeyError:
            return None
        if any(p not in self.files.entries for p in parts):
            return None
        shapes = [self.files.entries[p][2] for p in parts]
        dtype = self.files.entries[parts[0]][1]
        expert = ".mlp.experts.local_experts." in name
        rank, size = (c.etp_rank, c.etp_size) if expert else (c.tp_rank, c.tp_size)
        dim = tp_split_dim(local) if size > 1 else None
        if dim == 1:  # by columns: every row, this rank's columns
            (shape,) = shapes
            first, last = chunk_range(shape[1], size, rank)
            return SlicePlan((shape[0], last - first, *shape[2:]), dtype,
                             (Piece(parts[0], 0, shape[0], 0, (first, last)),))
        if kind == "qkv":
            pieces = self._qkv_pieces(parts, shapes, rank, size if dim == 0 else 1)
        elif kind == "fc1":  # [gate; up], each split by rank
            rows = chunk_range(shapes[0][0], size if dim == 0 else 1, rank if dim == 0 else 0)
            n = rows[1] - rows[0]
            pieces = [Piece(parts[0], *rows, 0), Piece(parts[1], *rows, n)]
        else:
            rows = chunk_range(shapes[0][0], size, rank) if dim == 0 else (0, shapes[0][0])
            pieces = [Piece(parts[0], *rows, 0)]
        pieces = [p for p in pieces if p.stop > p.start]
        total = sum(p.stop - p.start for p in pieces)
        return SlicePlan((total, *shapes[0][1:]), dtype, tuple(pieces))

    def _qkv_pieces(self, parts: tuple[str, ...], shapes: list[tuple], rank: int, size: int) -> list[Piece]:
        """The fused rows ``torch.chunk`` gives ``rank`` of Megatron's per-group [q heads; k; v] layout, as row ranges
        of the HF q, k and v tensors."""
        heads, kv, d = head_layout(self.cfg)
        widths = (heads // kv * d, d, d)  # rows of q, k, v in one query group
        group = sum(widths)
        if tuple(s[0] for s in shapes) != tuple(kv * w for w in widths):
            raise ValueError(f"{self.files.path}: {parts} have {[s[0] for s in shapes]} rows; config.json's heads "
                             f"({heads} query, {kv} kv, head_dim {d}) imply {[kv * w for w in widths]}")
        start, stop = chunk_range(kv * group, size, rank)
        pieces = []
        for g in range(start // group, -(-stop // group)):
            offset = g * group  # the group's first fused row
            for part, width in zip(parts, widths):
                lo, hi = max(start, offset), min(stop, offset + width)
                if hi > lo:
                    pieces.append(Piece(part, g * width + lo - offset, g * width + hi - offset, lo - start))
                offset += width
        return pieces

    def read(self, plan: SlicePlan, out: torch.Tensor | None = None) -> torch.Tensor:
        """The shard ``plan`` describes, read into ``out`` (a CPU tensor of the plan's shape, cast to its dtype as
        ``Tensor.copy_`` casts) or a new tensor of the file's dtype."""
        if out is None:
            out = torch.empty(plan.shape, dtype=plan.dtype)
        if tuple(out.shape) != plan.shape:
            raise ValueError(f"{self.files.path}: a shard of shape {plan.shape} cannot go into {tuple(out.shape)}")
        with torch.no_grad():
            for piece in plan.pieces:
                self._read_piece(piece, out.detach()[piece.at:piece.at + piece.stop - piece.start])
        return out

    def _read_piece(self, piece: Piece, dst: torch.Tensor) -> None:
        _, dtype, shape, _, _ = self.files.entries[piece.name]
        if piece.columns is None and dst.dtype == dtype and dst.is_contiguous() and dst.device.type == "cpu":
            self.files.read_rows(piece.name, piece.start, piece.stop, out=dst)  # in place: nothing in flight
            return
        row_bytes = dtype.itemsize
        for s in shape[1:]:
            row_bytes *= s
        step = max(1, self.block_bytes // max(row_bytes, 1))
        for a in range(piece.start, piece.stop, step):
            b = min(a + step, piece.stop)
            rows = self.files.read_rows(piece.name, a, b)
            if piece.columns is not None:
                rows = rows[:, piece.columns[0]:piece.columns[1]]
            dst[a - piece.start:b - piece.start].copy_(rows)
