"""Checkpoint keys that only some layers have: their layer axis renumbered over those layers.

megatron-core stacks each layer's tensor under one key, ``decoder.layers.<name>``, whose leading
axis is the global layer index over *all* layers (``TransformerBlock.sharded_state_dict``). When the
layers differ — Qwen2-MoE's dense ``mlp_only_layers`` or ``decoder_sparse_step`` > 1 beside its MoE
layers — some keys exist at some layers only: the router, experts and shared expert at the MoE
layers, the dense ``mlp.linear_fc1``/``linear_fc2`` at the dense ones. megatron's integrity check
refuses those holes on save and on load ("Invalid access pattern for ShardedTensor(key=
'decoder.layers.mlp.router.weight' ...)"), so such a model could neither save nor load.

``compact_layer_keys`` renumbers the leading axis of each such key over the layers that have it, in
order. Example, 4 layers with layer 3 dense: ``decoder.layers.mlp.router.weight`` has shape
(3, E, H), layers 0, 1, 2 at 0, 1, 2; ``decoder.layers.mlp.linear_fc1.weight`` has shape
(1, 2F, H), layer 3 at 0. A key every layer has keeps its axis over all layers, so a model whose
layers are alike (every other family, Qwen2-MoE without dense layers) saves exactly as before, and
``identity.py`` still reads layers (attention) and experts (router) from the stacked shapes.
Which layer is which slot follows from the model's config (``is_moe_layer``), as the layer specs do.

megatron's own answer (``hetereogenous_dist_checkpoint``: every tensor of every layer under its own
key ``decoder.layers.<i>.<name>``) would rename every key of such a model, attention included.

The trainer's save and load (``dist._sharded``) and the HF converter (``convert.py``) both describe
the model through this function, so ``hf-to-mcore`` writes the layout the trainer saves and loads.
"""

from __future__ import annotations

import functools

import torch.distributed as dist

_PREFIX = "decoder.layers."


def _stacked_key(key: str) -> bool:
    """A key stacked over the layers (not megatron's per-layer ``decoder.layers.<i>.`` form)."""
    return key.startswith(_PREFIX) and not key[len(_PREFIX):][:1].isdigit()


def _parts(entry) -> list:
    """The ShardedTensors / ShardedObjects ``entry`` stands for (a factory's are built: views, no copy)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    if isinstance(entry, ShardedTensorFactory):
        return [p for p in nested_values(entry.build()) if isinstance(p, (ShardedTensor, ShardedObject))]
    return [entry] if isinstance(entry, (ShardedTensor, ShardedObject)) else []


def _has_layer_axis(part) -> bool:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return bool(part.global_shape) and (not isinstance(part, ShardedTensor) or part.prepend_axis_num >= 1)


def _layer_of(part) -> tuple[int, int] | None:
    """(global layer, number of layers) of a layer-stacked model tensor or object, else None."""
    if not _stacked_key(part.key) or not _has_layer_axis(part):
        return None
    return part.global_offset[0], part.global_shape[0]


def _renumber(part, layers: list[int]) -> None:
    """Put ``part`` (whose leading axis is a global layer) on the axis over ``layers`` only."""
    n = len(layers)
    part.global_offset = (layers.index(part.global_offset[0]), *part.global_offset[1:])
    part.global_shape = (n, *part.global_shape[1:])
    if getattr(part, "axis_fragmentations", None) is not None:
        part.axis_fragmentations = (n, *part.axis_fragmentations[1:])


def _renumbering_build(build_fn, layers: list[int]):
    """A factory's build function whose tensors come out renumbered: the optimizer's copies of the
    factory build through it too, their keys prefixed (``optimizer.state.exp_avg.decoder.layers...``)."""

    @functools.wraps(build_fn)
    def build(*args, **kwargs):
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

        out = build_fn(*args, **kwargs)
        for part in nested_values(out):
            if isinstance(part, (ShardedTensor, ShardedObject)) and _has_layer_axis(part):
                _renumber(part, layers)
        return out

    build.megarl_layers = layers
    return build


def compact_layer_keys(state_dicts: list[dict]) -> list[dict]:
    """Renumber, in place, the layer axis of every key that not all layers have (see the module
    docstring) in the model sharded state dicts of this rank's model chunks; returns them.

    Collective when torch.distributed runs with more than one process: under pipeline parallelism a
    rank sees its own layers only, so the layers each key has are gathered from every rank. Every
    rank must call it (the checkpoint save and load it serves are collective too)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    entries = [e for sd in state_dicts for e in nested_values(sd)]
    have: dict[str, set[int]] = {}
    total: dict[str, int] = {}
    located = []  # (entry, the key deciding its renumbering)
    for entry in entries:
        for part in _parts(entry):
            where = _layer_of(part)
            if where is None:
                continue
            have.setdefault(part.key, set()).add(where[0])
            total[part.key] = where[1]
            located.append((entry, part.key))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (have, total))
        for their_have, their_total in gathered:
            for key, layers in their_have.items():
                have.setdefault(key, set()).update(layers)
                total[key] = their_total[key]
    partial = {key: sorted(layers) for key, layers in have.items() if len(layers) < total[key]}
    if not partial:
        return state_dicts
    done = set()
    for entry, key in located:
        if key not in partial or id(entry) in done:
            continue
        done.add(id(entry))
        if isinstance(entry, ShardedTensorFactory):
            if getattr(entry.build_fn, "megarl_layers", None) is None:
                entry.build_fn = _renumbering_build(entry.build_fn, partial[key])
        else:
            _renumber(entry, partial[key])
    return state_dicts
