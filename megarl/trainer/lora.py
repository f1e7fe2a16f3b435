"""LoRA adapters on megatron-core's parallel linear layers, sharded as each base layer is (``lora.*``).

An adapted layer computes ``W x + (alpha / r) · B A dropout(x)``: the base ``W`` frozen in the trainer's precision
(no gradient, no main copy, no optimizer state: megatron's DDP and optimizer skip parameters that need no
gradient), ``A`` [r, in] and ``B`` [out, r] trained, ``B`` starting at zero so that the adapted model starts as the
base. Each adapter is a module ``lora`` on its base layer (``…linear_qkv.lora.a``), run by a forward hook: the base
layer, its parameters and their names stay as they are (the HF maps, the weight sync and checkpoints read them).

Sharding, at tensor-parallel size ``tp`` (``h``: the rank-r activation between A and B)::

    column-parallel (linear_qkv, linear_fc1): A [r, in] replicated, B [out/tp, r] split on the output
        no SP:  h = A x              → copy to the TP region (backward: dh all-reduced)  → B h
        SP:     h = A x_shard        → gather the sequence   (backward: reduce-scatter)  → B h
                (A on the rank's own positions, the base layer's gathered input as a sum of them; A's gradient
                 is then partial over positions: summed over TP as a sequence-parallel norm's is)
    row-parallel (linear_proj, linear_fc2): A [r, in/tp] split on the input, B [out, r] replicated
        no SP:  h = A_rank x_rank    → all-reduce (as the base output is)                → B h
        SP:     h = A_rank x_rank    → reduce-scatter to the sequence shards             → B h
                (B's gradient partial over positions: summed over TP)

Routed experts (``lora.targets`` ``experts``): every local expert's linear_fc1 and linear_fc2 its own adapter, on
the rank EP puts the expert, its parameters marked as megatron marks the expert's weights (``allreduce`` False under
EP: reduced over the expert-data-parallel group, not DP), saved under the expert's global number as its weights are
(``SequentialMLP.sharded_state_dict``). Under expert TP (``parallel.etp`` = ``parallel.tp``) the split factor is
split as above, but the layer moves no tokens itself (the dispatcher gathered them and sums its outputs): the
adapter's term stays a shard (column) or a partial sum (row) as the base output does, and the replicated factor's
gradient, partial on each expert-TP rank, is summed over expert TP in its backward (``copy_to`` on the parameter)::

    column (linear_fc1): out_shard += B_shard (A x)          dA = Σ_etp (B_shard^T dy_shard) x^T
    row    (linear_fc2): out_partial += B (A_shard x_shard)   dB = Σ_etp dy (A_shard x_shard)^T

``A`` is drawn whole for each layer (each expert) from a generator seeded by the seed, the layer's global number,
the target (and the expert's global number), then sliced: every layout starts from one process's adapters.
``adapters_off`` runs the model as the base (the reference of the KL penalty without a second model in memory).

Dropout (``lora.dropout``) draws its masks from megatron's RNG tracker, so that a full recompute replays them: an
input every TP rank holds whole (a column-parallel layer without SP; an expert's linear_fc1 at expert TP > 1, whose
tokens the dispatcher gathered) from ``TIED``, alike over the TP group (the ranks' replicated A stays one tensor) and
set again before each RL step from the seed, the step and the group (``tie_dropout``: a resume at any layout, from a
checkpoint with or without the stream, draws the uninterrupted run's masks); an input split over TP (row-parallel,
or a sequence shard) from megatron's per-rank stream (``model-parallel-rng``; an expert's ``expert-parallel-rng``,
which run checkpoints keep), as megatron draws its own dropout.

In dist checkpoints (``checkpoint/dist.py``) the adapters are the base layer's ``lora.a`` / ``lora.b`` with the
sharding above (``LoraAdapter.sharded_state_dict``; megatron's own layers call every tensor but their ``weight`` and
``bias`` replicated), a gated linear_fc1's B with its gate and up halves stored apart as megatron stores that weight:
they and their optimizer state reshard across TP.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from megarl.compat.megatron import frozen_linear_backward_in_2d
from megarl.config.schema import LoraConfig
from megarl.config.validate.lora import TARGETS, lora_targets
from megarl.distributed.rng import seeded_rng_state

COLUMN, ROW = ("linear_qkv", "linear_fc1"), ("linear_proj", "linear_fc2")
LAYERS = {False: ("ColumnParallelLinear", "TELayerNormColumnParallelLinear", "TEColumnParallelLinear"),
          True: ("RowParallelLinear", "TERowParallelLinear")}
"""The layers adapters sit on, column- (False) and row-parallel (True): megatron-core's own and its Transformer
Engine wrappers (by class name: Transformer Engine exists on GPUs only)."""
TIED = "lora-dropout-tied"
"""The tracker's stream for the dropout of an input replicated over TP: one seed per TP group."""


class LoraAdapter(torch.nn.Module):
    """One base layer's adapter: ``a`` [r, in (/tp)], ``b`` [out (/tp), r], the scale alpha / r, the input dropout,
    and how the rank-r activation crosses the TP group (``row``: the input is split; else the output)."""

    def __init__(self, base: torch.nn.Module, row: bool, rank: int, alpha: float, dropout: float,
                 glu: bool = False) -> None:
        super().__init__()
        self.glu = glu  # a gated linear_fc1's: B's rows are [gate shard; up shard] as the base weight's
        weight = base.weight
        out_features, in_features = weight.shape  # this rank's shard
        self.row, self.scale, self.enabled = row, alpha / rank, True
        # (megatron's Transformer Engine wrappers keep the group as _tp_group)
        self.tp_group = getattr(base, "tp_group", None) or getattr(base, "_tp_group", None)
        self.sequence_parallel = bool(base.sequence_parallel)
        # an expert's layer under EP or expert TP: the token dispatcher moves its inputs and outputs across ranks
        self.explicit = bool(getattr(base, "explicit_expert_comm", False))
        if self.explicit:
            self.sequence_parallel = False
        self.tp = self.tp_group.size() if self.tp_group is not None else 1
        self.tp_rank = self.tp_group.rank() if self.tp_group is not None else 0
        self.a = torch.nn.Parameter(torch.empty(rank, in_features, dtype=weight.dtype, device=weight.device))
        self.b = torch.nn.Parameter(torch.zeros(out_features, rank, dtype=weight.dtype, device=weight.device))
        self.dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
        self.tied_seed = 0  # (``tie_dropout``: the TIED stream's seed, alike over the TP group)
        replicated = not row and (self.tp > 1 if self.explicit else not self.sequence_parallel)
        self.rng = TIED if replicated else "expert-parallel-rng" if self.explicit else "model-parallel-rng"
        if self.tp > 1:
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            # the split factor as megatron tags its own shards (the grad norm counts it on every rank); the
            # replicated one, partial over positions under SP, is summed over TP by megatron's finalize_model_grads
            split, replicated = (self.a, self.b) if row else (self.b, self.a)
            set_tensor_model_parallel_attributes(split, True, 1 if row else 0, 1)
            replicated.sequence_parallel = self.sequence_parallel

    @torch.no_grad()
    def reset(self, init: str, generator: torch.Generator) -> None:
        """B to zero; A drawn whole ([r, in × tp] for a row-parallel layer), this rank's columns kept:
        'kaiming' is PEFT's default (uniform, bound 1/√in), 'gaussian' N(0, 1/r²)."""
        rank, local = self.a.shape
        whole = torch.empty(rank, local * self.tp if self.row else local, dtype=torch.float32)
        if init == "kaiming":
            torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=generator)
        elif init == "gaussian":
            torch.nn.init.normal_(whole, std=1.0 / rank, generator=generator)
        else:
            raise ValueError(f"lora.init must be 'kaiming' or 'gaussian', got {init!r}")
        if self.row:
            whole = whole[:, self.tp_rank * local:(self.tp_rank + 1) * local]
        self.a.copy_(whole)
        self.b.zero_()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """``a`` and ``b`` for a dist checkpoint, sharded as they are: B on dim 0 for a column-parallel layer (a gated
        linear_fc1's through megatron's own factory for its weight: gate and up each split over TP), A on dim 1 for a
        row-parallel one, the other replicated. The optimizer's state follows (it is described by these)."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        metadata = metadata or {}
        sd = make_sharded_tensors_for_checkpoint({"a": self.a, "b": self.b}, prefix, {"a": 1} if self.row else {"b": 0},
                                                 sharded_offsets, tp_group=self.tp_group,
                                                 dp_cp_group=metadata.get("dp_cp_group"))
        if self.glu:
            sd[f"{prefix}b"] = apply_swiglu_sharded_factory(sd[f"{prefix}b"], sharded_offsets,
                                                            metadata.get("singleton_local_shards", False))
        return sd

    def dropped(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` through the adapter's dropout, its mask drawn from the tracker's stream ``self.rng``."""
        if not (self.training and isinstance(self.dropout, torch.nn.Dropout)):
            return x
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        tracker = get_cuda_rng_tracker()
        if self.rng == TIED and TIED not in tracker.get_states():  # (tracker states loaded from before the stream)
            tracker.states_[TIED] = seeded_rng_state(self.tied_seed)
        with tracker.fork(self.rng):
            return self.dropout(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's term of the base layer's output, laid out as that output is."""
        from megatron.core.tensor_parallel import mappings as tp_map

        x = self.dropped(x)
        if self.explicit:  # the base layer's output stays a shard (column) or a partial sum (row) for the dispatcher
            a, b = (self.a, tp_map.copy_to_tensor_model_parallel_region(self.b, group=self.tp_group)) if self.row \
                else (tp_map.copy_to_tensor_model_parallel_region(self.a, group=self.tp_group), self.b)
            return F.linear(F.linear(x, a), b) * self.scale
        h = F.linear(x, self.a)
        if self.row and self.sequence_parallel:
            h = tp_map.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
        elif self.row:
            h = tp_map.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        elif self.sequence_parallel:
            h = tp_map.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=self.tp_group)
        else:
            h = tp_map.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        return F.linear(h, self.b) * self.scale


def _add_adapter(module: torch.nn.Module, args: tuple, kwargs: dict, output):
    """Forward hook of an adapted layer: its ``(output, bias)`` with the adapter's term added to the output."""
    adapter = module.lora
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs.get("input_", kwargs.get("x"))
    out, bias = output
    return out + adapter(normed_input(module, x)), bias


def normed_input(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What ``layer``'s weight multiplies: ``x`` itself, or for a fused norm+linear layer (Transformer Engine's
    ``LayerNormLinear``, the input norm inside the layer) ``x`` through that norm, RMSNorm or LayerNorm with the
    layer's own weight (``1 + weight`` when zero-centred), bias and epsilon, in ``x``'s dtype (torch's norms
    accumulate a bf16 input in fp32, as the layer does, and keep no fp32 copy of it for the backward). Per position,
    so a sequence shard is normed alone. The adapter keeps this output for its backward: one activation of the
    layer's input width, as megatron's own spec keeps its separate norm's."""
    gamma = getattr(layer, "layer_norm_weight", None)
    if gamma is None:
        return x
    gamma = (gamma.float() + 1 if layer.zero_centered_gamma else gamma).to(x.dtype)
    shape = (x.shape[-1],)
    if layer.normalization == "RMSNorm":
        return F.rms_norm(x, shape, gamma, layer.eps)
    if layer.normalization == "LayerNorm":
        beta = layer.layer_norm_bias
        return F.layer_norm(x, shape, gamma, None if beta is None else beta.to(x.dtype), layer.eps)
    raise ValueError(f"{type(layer).__name__}: a fused {layer.normalization!r} norm takes no adapter")


def _sharded_with_adapter(base: torch.nn.Module, prefix: str = "", sharded_offsets: tuple = (),
                          metadata: dict | None = None) -> dict:
    """An adapted layer's ``sharded_state_dict``: its class's for the base tensors, the adapter's for ``lora.*``."""
    sd = type(base).sharded_state_dict(base, prefix, sharded_offsets, metadata)
    sd = {k: v for k, v in sd.items() if not k.startswith(f"{prefix}lora.")}
    return {**sd, **base.lora.sharded_state_dict(f"{prefix}lora.", sharded_offsets, metadata)}


def apply_lora(modules: list[torch.nn.Module], lora: LoraConfig, seed: int = 0) -> list[LoraAdapter]:
    """Adapters on every targeted layer of the model chunks (``lora.targets``), every other parameter frozen;
    returns the adapters. The layers are megatron-core's own ColumnParallelLinear / RowParallelLinear (its local
    spec) or its Transformer Engine wrappers (``LAYERS``; a fused norm+linear's adapter takes the normed input);
    Transformer Engine's grouped experts take none: with ``experts`` targeted the trainer builds SequentialMLP's
    (``config.validate.lora.lora_on_experts``)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    kinds = lora_targets(lora)
    frozen_linear_backward_in_2d()  # (megatron's backward through a frozen layer copied its weight per token)
    for m in modules:
        for p in m.parameters():
            p.requires_grad_(False)
    adapters = []
    for m in modules:
        for layer in (x for x in m.modules() if isinstance(x, TransformerLayer)):
            for name, base in layer.named_modules():
                if name == "mlp.experts" and "experts" in kinds and type(base).__name__ != "SequentialMLP":
                    raise TypeError(f"lora.targets: experts are a {type(base).__name__} here (grouped GEMMs); "
                                    "adapters are built on SequentialMLP's experts only")
                kind, expert = _target_kind(name)
                what = "experts" if expert is not None else kind
                if what not in kinds:
                    continue
                row = kind in ROW
                if type(base).__name__ not in LAYERS[row] or getattr(base, "gather_output", False):
                    raise TypeError(f"lora.targets: {what} ({TARGETS[what]}) is a {type(base).__name__} here; "
                                    f"adapters are built on {', '.join(LAYERS[row])} only")
                glu = kind == "linear_fc1" and bool(base.config.gated_linear_unit)
                base.lora = LoraAdapter(base, row, lora.rank, lora.alpha, lora.dropout, glu)
                seed_of = seed * 1_000_003 + layer.layer_number * 16
                if expert is None:
                    seed_of += kinds.index(kind)
                else:  # each global expert its own A (the layer's experts spread over EP ranks: local + offset)
                    expert += _expert_offset(layer)
                    seed_of = (seed_of + len(TARGETS)) * 1_000_003 + 2 * expert + row
                base.lora.reset(lora.init, torch.Generator().manual_seed(seed_of))
                if not getattr(base.weight, "allreduce", True):  # an expert's under EP: reduced over expert DP
                    base.lora.a.allreduce = base.lora.b.allreduce = False
                base.register_forward_hook(_add_adapter, with_kwargs=True)
                base.sharded_state_dict = types.MethodType(_sharded_with_adapter, base)  # (dist checkpoints)
                adapters.append(base.lora)
    if not adapters:
        raise ValueError(f"lora.targets={lora.targets!r}: no layer of the model is one of them")
    if lora.dropout:
        tie_dropout(adapters, seed, step=0)
    for m in modules:
        if m.config.recompute_granularity == "full" and getattr(m, "decoder", None) is not None:
            m.decoder.register_forward_pre_hook(_input_needing_grad, with_kwargs=True)
    return adapters


def tie_dropout(found: list[LoraAdapter], seed: int, step: int) -> None:
    """The tracker's ``TIED`` stream set to the state of (``seed``, ``step``, the dense TP group's first global rank):
    alike on the group's ranks, another on each other group, whatever the tracker held before (a run checkpoint of
    another layout, or of a run without dropout). Before each RL step (``rl_update``) and once at start."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    dense = [a for a in found if not a.explicit] or found  # (experts alone: their expert-TP group, TP's when tied)
    group = dense[0].tp_group
    if group is not None:
        first = dist.get_process_group_ranks(group)[0]
    else:
        first = dist.get_rank() if dist.is_initialized() else 0
    for a in found:
        a.tied_seed = (seed * 1_000_003 + first) * 7919 + 104_729
    get_cuda_rng_tracker().states_[TIED] = seeded_rng_state(found[0].tied_seed * 1_000_003 + step)


def _input_needing_grad(block: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a decoder under full recompute: its input marked as needing a gradient. The first stage's
    comes from the frozen embedding and needs none, and megatron's recompute of a unit whose inputs need no gradient
    gives no backward, so the adapters inside would get no gradient (PEFT's ``enable_input_require_grads``)."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if not (torch.is_grad_enabled() and isinstance(hidden, torch.Tensor)) or hidden.requires_grad:
        return None
    hidden = hidden.detach().requires_grad_()
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": hidden}
    return (hidden, *args[1:]), kwargs


def _target_kind(name: str) -> tuple[str | None, int | None]:
    """(kind, local expert) of a layer's submodule by its name in the layer: ``self_attention.<kind>`` and
    ``mlp.<kind>`` (expert None), ``mlp.experts.local_experts.<i>.<kind>``; (None, None) for anything else (shared
    experts, norms, the router)."""
    parts = name.split(".")
    if len(parts) == 2 and parts[0] in ("self_attention", "mlp") and parts[1] in COLUMN + ROW:
        return parts[1], None
    if len(parts) == 5 and parts[:3] == ["mlp", "experts", "local_experts"] and parts[4] in ("linear_fc1",
                                                                                          "linear_fc2"):
        return parts[4], int(parts[3])
    return None, None


def _expert_offset(layer: torch.nn.Module) -> int:
    """The global number of this rank's first expert in ``layer`` (its EP rank × its local experts)."""
    experts = layer.mlp.experts
    return experts.ep_group.rank() * experts.num_local_experts


def adapters(modules: list[torch.nn.Module]) -> list[LoraAdapter]:
    """The model chunks' adapters, in module order."""
    return [x for m in modules for x in m.modules() if isinstance(x, LoraAdapter)]


@contextmanager
def adapters_off(modules: list[torch.nn.Module]) -> Iterator[None]:
    """The base model inside: every adapter skipped (its hook hands the base output back untouched)."""
    found = adapters(modules)
    were = [x.enabled for x in found]
    for x in found:
        x.enabled = False
    try:
        yield
    finally:
        for x, was in zip(found, were):
            x.enabled = was
