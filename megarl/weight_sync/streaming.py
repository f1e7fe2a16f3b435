"""Streaming, resharded weight sync: the trainer's Megatron shards → HF-named buckets → the engines.

No rank ever holds the whole model. Each tensor is sent by one rank — the TP leader of the
lowest group that holds it (pipeline stages and expert ranks own disjoint layers) — after a
gather onto it over its own TP group only (a TP peer gives its shard and never holds the whole
tensor); it is cast to the engine's dtype and re-laid out into
HF tensors straight into a bucket (``megarl.native``: ``split_qkv`` / ``split_gate_up`` /
``pack``), and the bucket is broadcast to every rank whose engine needs it (all of them, for
colocated engines). Every rank yields the bucket's HF (name, view) pairs to its engine, bucket
by bucket, layer by layer::

    plan (once: names + shapes only, all_gather_object of metadata)
      embedding │ layer 0 │ layer 1 │ … │ final norm, output layer     (sorted; a bucket never
                                                                         spans two senders)
    per bucket, on its sender                         on every rank
      TP gather ───▶ split / cast into bucket ─▶ broadcast ─▶ (hf name, view) … ─▶ engine

Peak extra memory on a rank: the bucket (``sync.bucket_mib``, or one tensor when larger) plus
the largest gathered tensor — independent of the number of layers. In one process (nothing to
broadcast) ``weights(zero_copy=True)`` hands a colocated engine views of the trainer's own
tensors wherever no gather, cast or re-layout is needed, and packs only the rest (the QKV split). The names and layouts
come from ``hf_adapter.megatron_to_hf`` run on meta tensors (one place for the rules); the kernels
only move bytes, and the tests hold the result equal to ``gather.gather_hf_weights``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl.models.hf_adapter import head_layout, megatron_to_hf
from megarl.models.hf_config import num_experts
from megarl.models.sharding import LAYER_NAME, global_name, local_expert_name, tp_split_dim
from megarl.weight_sync import native


@dataclass(frozen=True)
class Entry:
    """One Megatron tensor of the plan: who sends it and which HF tensors it becomes."""

    name: str  # global Megatron name
    source: int  # global rank that sends it
    shape: tuple[int, ...]  # full (TP-gathered) shape
    hf: tuple[tuple[str, tuple[int, ...]], ...]  # HF (name, shape) pieces, in bucket order

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.hf)


@dataclass
class SyncStats:
    """What one sync moved; ``peak_extra_bytes`` tracks this module's own buffers (bucket + gather)."""

    bytes: int = 0
    buckets: int = 0
    peak_extra_bytes: int = 0
    seconds: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {"sync/bytes": float(self.bytes), "sync/buckets": float(self.buckets),
                "sync/peak_extra_mib": self.peak_extra_bytes / 2**20}


def _order(entry_name: str, source: int) -> tuple:
    """Embedding first, then layer by layer (one sender's tensors together), then the head."""
    m = LAYER_NAME.match(entry_name)
    if m is not None:
        return (1, int(m.group(1)), source, entry_name)
    return (0 if entry_name.startswith("embedding.") else 2, 0, source, entry_name)


@dataclass
class _Local:
    param: torch.Tensor
    group: object  # its TP (or expert-TP) group, None when unsplit
    tp: int
    dim: int | None


@dataclass
class StreamingSync:
    """The plan of one trainer's weights and the iterator that streams them (``weights``)."""

    modules: list[torch.nn.Module]
    hf_cfg: dict
    ps: object  # ParallelState
    num_experts: int
    bucket_bytes: int = 64 << 20
    dtype: torch.dtype = torch.float32
    stats: SyncStats = field(default_factory=SyncStats)
    _plan: list[Entry] | None = None
    _local: dict[str, _Local] = field(default_factory=dict)
    _leader: dict[str, int] = field(default_factory=dict)
    _buckets: tuple | None = None  # ((bucket_bytes, dtype), the buckets) as last grouped
    _device: torch.device = torch.device("cpu")  # where the trainer's weights (and so the buckets) live

    @classmethod
    def of(cls, trainer, dtype: torch.dtype, bucket_mib: float) -> StreamingSync:
        """The stream of ``trainer``'s weights (a ``PolicyTrainer``: its chunks, config and layout), cast to
        ``dtype`` (the engines'), in buckets of ``bucket_mib``."""
        return cls(trainer.modules, trainer.hf_cfg, trainer.ps, num_experts(trainer.hf_cfg), int(bucket_mib * 2**20),
                   dtype)

    def plan(self) -> list[Entry]:
        if self._plan is None:
            self._plan = self._build_plan()
        return self._plan

    def _build_plan(self) -> list[Entry]:
        ps, layers = self.ps, self.hf_cfg["num_hidden_layers"]
        mine = []
        for vp, module in enumerate(self.modules):
            coords = ps.coords(vp)
            for local, p in module.named_parameters():
                local = local_expert_name(local)
                expert = ".experts." in local
                tp = ps.etp if expert else ps.tp
                dim = tp_split_dim(local) if tp > 1 else None
                group = None
                leader = ps.rank
                if dim is not None:
                    group = ps.etp_group if expert else ps.tp_group
                    leader = dist.get_process_group_ranks(group)[0]
                shape = list(p.shape)
                if dim is not None:
                    shape[dim] *= tp
                name = global_name(local, layers, self.num_experts, coords)
                self._device = p.device
                self._local[name] = _Local(p, group, tp, dim)
                self._leader[name] = leader
                mine.append((name, leader, tuple(shape)))
        every = [mine]
        if ps.world_size > 1:
            every = [None] * ps.world_size
            dist.all_gather_object(every, mine)
        best: dict[str, tuple[int, tuple]] = {}
        for part in every:
            for name, leader, shape in part:
                if name not in best or leader < best[name][0]:
                    best[name] = (leader, shape)
        plan = []
        for name, (source, shape) in best.items():
            pieces = tuple((n, tuple(t.shape)) for n, t in megatron_to_hf([(name, torch.empty(shape, device="meta"))],
                                                                            self.hf_cfg))
            if pieces:  # e.g. a tied output layer has no HF tensor of its own
                plan.append(Entry(name, source, shape, pieces))
        plan.sort(key=lambda e: _order(e.name, e.source))
        return plan

    def buckets(self) -> list[list[Entry]]:
        """Consecutive entries of one sender, up to ``bucket_bytes`` (a larger tensor alone); computed once."""
        key = (self.bucket_bytes, self.dtype)
        if self._buckets is None or self._buckets[0] != key:
            self._buckets = (key, self._group())
        return self._buckets[1]

    def _group(self) -> list[list[Entry]]:
        size = torch.empty((), dtype=self.dtype).element_size()
        out: list[list[Entry]] = []
        used = 0
        for e in self.plan():
            nbytes = e.numel * size
            if not out or out[-1][0].source != e.source or used + nbytes > self.bucket_bytes:
                out.append([])
                used = 0
            out[-1].append(e)
            used += nbytes
        return out

    @torch.no_grad()
    def weights(self, zero_copy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """HF (name, tensor) pairs of the whole model, streamed bucket by bucket; fills ``stats``.

        ``zero_copy`` (one process, nothing to broadcast): a tensor that needs no gather, cast or
        re-layout is handed over as a view of the trainer's own parameter instead of a copy in the
        bucket; only the rest (e.g. the QKV split) is packed. For a consumer that copies what it is
        given before the trainer changes it (a colocated engine's load), not for one that wants
        flat buckets (``engines.replicas.flat_buckets``)."""
        start, self.stats = time.perf_counter(), SyncStats()
        size = torch.empty((), dtype=self.dtype).element_size()
        direct = zero_copy and self.ps.world_size == 1
        for bucket_entries in self.buckets():
            views = {e.name: v for e in bucket_entries if (v := self._views(e) if direct else None) is not None}
            packed = [e for e in bucket_entries if e.name not in views]
            bucket = torch.empty(sum(e.numel for e in packed), dtype=self.dtype, device=self._device)
            source = bucket_entries[0].source
            offset = 0
            for e in packed:
                extra = self._fill(e, bucket[offset:offset + e.numel]) if e.name in self._local else 0
                self.stats.peak_extra_bytes = max(self.stats.peak_extra_bytes, bucket.nbytes + extra)
                offset += e.numel
            if self.ps.world_size > 1:
                dist.broadcast(bucket, src=source)
            self.stats.bytes += sum(e.numel for e in bucket_entries) * size
            self.stats.buckets += 1
            offset = 0
            for e in bucket_entries:
                if e.name in views:
                    yield from views[e.name]
                    continue
                for name, shape in e.hf:
                    n = math.prod(shape)
                    yield name, bucket[offset:offset + n].view(shape)
                    offset += n
            del bucket, views
        self.stats.seconds = time.perf_counter() - start

    @torch.no_grad()
    def owned_buckets(self) -> Iterator[torch.Tensor]:
        """The buckets this rank sends to engines in processes of their own, filled in plan order (collective over TP
        groups).

        Every rank walks every bucket so that the TP gathers of the owner's tensors happen; it
        keeps only the buckets it owns — no broadcast inside the trainer, no rank holds another's."""
        rank, self.stats = dist.get_rank(), SyncStats()
        empty = torch.empty(0, dtype=self.dtype)
        for entries in self.buckets():
            total = sum(e.numel for e in entries)
            mine = entries[0].source == rank
            bucket = torch.empty(total, dtype=self.dtype, device=self._device) if mine else empty
            offset = 0
            for e in entries:
                if e.name in self._local:
                    extra = self._fill(e, bucket[offset:offset + e.numel] if mine else empty)
                    self.stats.peak_extra_bytes = max(self.stats.peak_extra_bytes, bucket.nbytes + extra)
                offset += e.numel
            self.stats.bytes += total * empty.element_size()
            self.stats.buckets += 1
            if mine:
                yield bucket

    def piece_plan(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        """The HF (name, shape) pieces of each bucket, in send order (what a replica is told before the bytes)."""
        return [[(n, tuple(shape)) for e in entries for n, shape in e.hf] for entries in self.buckets()]

    def sends(self) -> tuple[Iterator[torch.Tensor], list[int]]:
        """For engines in processes of their own: this rank's flat buckets in plan order and the trainer rank each
        bucket of the plan comes from. One trainer process sends every bucket; several send their own
        (``owned_buckets``, a collective)."""
        if self.ps.world_size == 1:
            return flat_buckets(self.weights(), self.piece_plan()), [0] * len(self.buckets())
        return self.owned_buckets(), [entries[0].source for entries in self.buckets()]

    def _views(self, e: Entry) -> list[tuple[str, torch.Tensor]] | None:
        """``e``'s HF pieces as views of the local parameter, when they lie in it one after another as
        they are (one piece, or gate/up of an unsplit ``linear_fc1``) and it is in the engine's dtype."""
        loc = self._local.get(e.name)
        if loc is None or loc.dim is not None or loc.param.dtype != self.dtype or not loc.param.is_contiguous():
            return None
        if len(e.hf) != 1 and not (e.name.endswith("linear_fc1.weight") and len(e.hf) == 2):
            return None
        flat = loc.param.detach().view(-1)
        return [(name, flat[o:o + math.prod(s)].view(s)) for o, (name, s) in zip(_offsets(e.hf), e.hf)]

    def _fill(self, e: Entry, out: torch.Tensor) -> int:
        """Write entry ``e``'s HF pieces into ``out`` (on its TP group; only the sender's copy is sent).

        Returns the bytes of the temporary gather buffer (the sender's; a TP peer only gives its shard)."""
        loc = self._local[e.name]
        if self._leader[e.name] != e.source:
            return 0  # another replica (data-parallel rank) sends it
        t = loc.param.detach()
        extra = 0
        if loc.dim is not None:  # gathered onto the sender only: a TP peer never holds the whole tensor
            if dist.get_rank() != e.source:
                dist.gather(t.contiguous(), None, dst=e.source, group=loc.group)
                return 0  # a TP peer of the sender: it only gave its shard
            gathered = torch.empty((loc.tp * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
            dist.gather(t.contiguous(), list(gathered.chunk(loc.tp, dim=0)), dst=e.source, group=loc.group)
            extra = gathered.nbytes
            if loc.dim == 1:  # shards side by side: [tp, rows, cols/tp] → [rows, tp, cols/tp]
                rows = t.shape[0]
                out.view(rows, loc.tp, -1).copy_(gathered.view(loc.tp, rows, -1).transpose(0, 1))
                return extra
            t = gathered
        views = [out[o:o + math.prod(s)].view(s) for o, s in zip(_offsets(e.hf), (s for _, s in e.hf))]
        if e.name.endswith(("linear_qkv.weight", "linear_qkv.bias")) and len(views) == 3:
            native.split_qkv(t, head_layout(self.hf_cfg)[1], *views)
        elif e.name.endswith("linear_fc1.weight") and len(views) == 2:
            native.split_gate_up(t, loc.tp if loc.dim is not None else 1, *views)
        elif len(views) == 1:
            native.pack([t], out)
        else:  # a layout without a kernel: the adapter's own views, copied with a cast
            for view, (_, piece) in zip(views, megatron_to_hf([(e.name, t)], self.hf_cfg)):
                view.copy_(piece)
        return extra


def _offsets(pieces) -> list[int]:
    out, o = [], 0
    for _, shape in pieces:
        out.append(o)
        o += math.prod(shape)
    return out


def flat_buckets(weights: Iterator[tuple[str, torch.Tensor]], plan: list) -> Iterator[torch.Tensor]:
    """Streamed (name, view) pairs regrouped into the flat bucket tensors of ``plan`` (``piece_plan``) they view."""
    it = iter(weights)
    for pieces in plan:
        views = [next(it)[1] for _ in pieces]
        base = views[0]._base
        total = sum(v.numel() for v in views)
        if base is not None and base.dim() == 1 and base.numel() == total:
            yield base
        else:
            yield torch.cat([v.reshape(-1) for v in views])


class WeightsOverride:
    """A stream with ``stream``'s plan whose tensors are ``weights`` instead (a test's, a bench's, an injected
    fault's): rank 0 sends every bucket of them, as one trainer process would."""

    def __init__(self, stream: StreamingSync, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.stream, self._weights, self.dtype = stream, weights, stream.dtype

    @property
    def stats(self) -> SyncStats:
        return self.stream.stats

    def buckets(self) -> list[list[Entry]]:
        return self.stream.buckets()

    def piece_plan(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        return self.stream.piece_plan()

    def weights(self, zero_copy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        return self._weights

    def sends(self) -> tuple[Iterator[torch.Tensor], list[int]]:
        return flat_buckets(self._weights, self.piece_plan()), [0] * len(self.buckets())
