"""Split full Megatron tensors into one rank's shards (TP / PP / EP), and put them back.

Rules (Megatron-core local spec):

- TP splits ``embedding`` / ``output_layer`` by vocab rows, ``linear_qkv`` by rows
  (its per-group layout makes a contiguous split hand each rank whole query
  groups), ``linear_fc1`` by rows of gate and of up separately (each rank holds
  cat(gate shard, up shard)), ``linear_proj`` / ``linear_fc2`` by columns; norms
  and the router are replicated. Expert weights split the same way over the
  expert-tensor-parallel size.
- PP renumbers layers: stage ``s`` holds layers ``[s·n, (s+1)·n)`` as local ``0..n-1``. With
  ``v`` virtual stages (interleaved schedule) the model is cut in ``pp·v`` pieces of ``n``
  layers and chunk ``c`` of stage ``s`` holds piece ``c·pp + s``.
- EP renumbers experts: rank ``r`` holds experts ``[r·m, (r+1)·m)`` as local ``0..m-1``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")  # Megatron: layer index, rest
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits: its rank and size in each model-parallel dimension."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    vp_rank: int = 0
    vp_size: int = 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0 and self.vp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1 and self.vp_rank == self.vp_size - 1

    def first_layer(self, num_layers: int) -> int:
        """Global index of this (virtual) stage's first layer."""
        return (self.vp_rank * self.pp_size + self.pp_rank) * layers_per_stage(num_layers, self.pp_size, self.vp_size)


# Transformer Engine's grouped-GEMM experts: one module per layer, one weight per local expert.
_TE_GROUPED = re.compile(r"^(.*\.mlp\.experts)\.(linear_fc[12])\.weight(\d+)$")
_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def local_expert_name(name: str) -> str:
    """``...mlp.experts.linear_fc1.weight3`` (TE grouped GEMM) →
    ``...mlp.experts.local_experts.3.linear_fc1.weight``."""
    return _TE_GROUPED.sub(r"\1.local_experts.\3.\2.weight", name)


def grouped_expert_name(name: str) -> str:
    """Inverse of ``local_expert_name``."""
    return _LOCAL_EXPERT.sub(r"\1.\3.weight\2", name)


def tp_split_dim(name: str) -> int | None:
    """The dimension a tensor is split along under TP, or None when it is replicated."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")):
        return 0
    if name.endswith("linear_fc1.weight"):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def _split(name: str, t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    dim = tp_split_dim(name)
    if dim is None or size == 1:
        return t
    if name.endswith("linear_fc1.weight"):
        gate, up = torch.chunk(t, 2, dim=0)
        return torch.cat([torch.chunk(gate, size, 0)[rank], torch.chunk(up, size, 0)[rank]], dim=0)
    return torch.chunk(t, size, dim=dim)[rank].contiguous()


def _join(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    dim = tp_split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if name.endswith("linear_fc1.weight"):
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def layers_per_stage(num_layers: int, pp_size: int, vp_size: int = 1) -> int:
    if num_layers % (pp_size * vp_size):
        raise ValueError(f"num_layers {num_layers} is not divisible by pipeline size {pp_size} × "
                         f"virtual stages {vp_size}")
    return num_layers // (pp_size * vp_size)


def shard_for_rank(full: dict[str, torch.Tensor], num_layers: int, num_experts: int,
                   c: RankCoords) -> dict[str, torch.Tensor]:
    """The tensors rank ``c`` holds, under the local names its GPTModel uses."""
    per_stage = layers_per_stage(num_layers, c.pp_size, c.vp_size)
    first_layer = c.first_layer(num_layers)
    per_ep = num_experts // c.ep_size if num_experts else 0
    out = {}
    for name, t in full.items():
        m = LAYER_NAME.match(name)
        if m is None:
            if name.startswith("embedding.") and not c.is_first_stage:
                continue
            if name.startswith(("output_layer.", "decoder.final_layernorm.")) and not c.is_last_stage:
                continue
            out[name] = _split(name, t, c.tp_rank, c.tp_size)
            continue
        layer, rest = int(m.group(1)), m.group(2)
        if not first_layer <= layer < first_layer + per_stage:
            continue
        local = f"decoder.layers.{layer - first_layer}."
        e = _EXPERT.match(rest)
        if e is None:
            out[local + rest] = _split(name, t, c.tp_rank, c.tp_size)
            continue
        expert = int(e.group(1))
        if not c.ep_rank * per_ep <= expert < (c.ep_rank + 1) * per_ep:
            continue
        new = f"{local}mlp.experts.local_experts.{expert - c.ep_rank * per_ep}.{e.group(2)}"
        out[new] = _split(new, t, c.etp_rank, c.etp_size)
    return out


def global_name(local: str, num_layers: int, num_experts: int, c: RankCoords) -> str:
    """A rank's local parameter name → the global one (layer and expert indices)."""
    m = LAYER_NAME.match(local)
    if m is None:
        return local
    layer = int(m.group(1)) + c.first_layer(num_layers)
    rest = m.group(2)
    e = _EXPERT.match(rest)
    if e is not None:
        expert = int(e.group(1)) + c.ep_rank * (num_experts // c.ep_size)
        rest = f"mlp.experts.local_experts.{expert}.{e.group(2)}"
    return f"decoder.layers.{layer}.{rest}"


def join_tp_shards(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Reassemble one tensor from its TP (or expert-TP) shards in rank order."""
    return _join(name, shards)
