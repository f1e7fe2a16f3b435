"""The keys a checkpoint of each model gets, checked by megatron's own integrity check (no weights: meta).

    python tests/workers/layer_axis_checks.py MODEL_DIR [MODEL_DIR ...]

For each HF model dir: the converter's skeleton (the trainer's model at TP=1/PP=1 on the meta
device) described as the trainer saves it (``convert.skeleton_state``), its factories applied, and
the optimizer's copy of every tensor (what a plain optimizer's state adds, factories included)
put through ``validate_sharding_integrity``, which refused Qwen2-MoE with dense layers ("Invalid
access pattern"). Prints one JSON line: per model, the global shape of a few keys, and whether
the description equals megatron's own (``sharded_state_dict`` as is) key for key.
"""

from __future__ import annotations

import json
import sys

import torch

SHOWN = ("decoder.layers.mlp.router.weight", "decoder.layers.mlp.linear_fc1.weight",
         "decoder.layers.mlp.experts.experts.linear_fc1.weight", "decoder.layers.self_attention.linear_qkv.weight",
         "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight")


def _flat(state: dict) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, apply_factories

    state = dict(state)
    apply_factories(state)
    return [v for v in nested_values(state) if isinstance(v, ShardedBase)]


def main(*model_dirs: str) -> None:
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    from megatron.core.dist_checkpointing.validation import determine_global_metadata, validate_sharding_integrity

    from megarl.convert.dist_hf import skeleton, skeleton_state
    from megarl.models.hf_config import read_hf_config

    out = {}
    for model_dir in model_dirs:
        cfg = read_hf_config(model_dir)
        state = skeleton_state(cfg)
        optim = {f"exp_avg {k}": make_sharded_optimizer_tensor(v, torch.empty(v.data.shape, device="meta"),
                                                               "optimizer.state.exp_avg")
                 for k, v in state.items() if hasattr(v, "data") and isinstance(v.data, torch.Tensor)}
        parts = _flat({**state, **optim})
        validate_sharding_integrity(determine_global_metadata(parts)[1])
        shapes = {p.key: list(p.global_shape) for p in parts if p.key in SHOWN}
        megatron = {(p.key, tuple(p.global_shape), tuple(p.global_offset))
                    for p in _flat(skeleton(cfg).sharded_state_dict())}
        ours = {(p.key, tuple(p.global_shape), tuple(p.global_offset)) for p in _flat(state)}
        out[model_dir] = {"shapes": shapes, "as_megatron": ours == megatron}
    print(json.dumps({"ok": True, "models": out}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
