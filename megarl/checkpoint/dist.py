"""Model + optimizer as a megatron-core dist checkpoint (torch_dist), loadable at another layout.

A checkpoint saved at TP=2 / PP=2 / EP=2 (any DP, distributed optimizer or not) loads at
TP=1 / PP=1 / EP=1 and back: megatron-core stores each tensor by its global shape and
offsets (a key that only some layers have, as Qwen2-MoE's dense and MoE layers', is stored over
those layers: ``layer_axis.py``). Saving is atomic: the checkpoint is written to ``<path>.tmp`` and renamed; an old
checkpoint at ``path`` is first renamed to ``<path>.old`` and removed only after the new one is in place (a crash
between the renames leaves ``<path>.old``, which ``load_checkpoint`` then reads).

Known on megatron-core 0.16.1: with MoE and DP > 1 the optimizer is a ``ChainedOptimizer``
(dense and expert parts) whose sharded keys carry a ``chained_<i>.`` prefix; at EP=1/DP=1
there is one optimizer and no prefix, so a stock EP2→EP1 load fails with
``KeyError: ...chained_0.optimizer.state...``. ``load_checkpoint`` matches each requested
optimizer key to the saved one that differs only by that prefix (``_match_chain_prefixes``).
The distributed optimizer is saved ``fully_reshardable`` (per parameter, canonical layout),
so its state reshards over TP/PP/EP/DP rather than over DP only. Loading *into* it needs three
more repairs, each below: Adam's ``step`` tensor shared by every parameter (``compat.megatron.untie_adam_steps``),
main params a plain optimizer never saved (``_drop_unsaved_main_params``), and param groups of a
plain optimizer or of EP = 1 put in the distributed, chained form (``_align_chain``).

LoRA adapters (``trainer/lora.py``) are saved with the model, sharded as they are, and reshard across TP with their
optimizer state; a checkpoint whose adapters differ from the loading trainer's (none against some, other targets, rank
or alpha) is refused with what differs named (``_check_adapters``), never loaded as the base alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.checkpoint.layer_axis import compact_layer_keys
from megarl.compat.megatron import describe_fresh_state, patch_step_copy, untie_adam_steps

LAYOUT_FILE = "megarl_layout.json"
"""Written beside a dist checkpoint: the parallel layout that saved it."""


def _chain(optimizer) -> list:
    """The optimizers of a megatron ``ChainedOptimizer`` (dense and expert parts), or just this one."""
    return getattr(optimizer, "chained_optimizers", None) or [optimizer]


def _model_keys(trainer) -> list[str]:
    """megatron's names for the model chunks in a checkpoint: 'model', or 'model0', 'model1', ...
    under virtual pipeline stages (tensors are matched by their global keys, not by these)."""
    return _chunk_keys(trainer.modules)


def _chunk_keys(modules: list) -> list[str]:
    return ["model"] if len(modules) == 1 else [f"model{i}" for i in range(len(modules))]


def _sharded(trainer, is_loading: bool, with_optimizer: bool = True) -> dict:
    # Keys that only some layers have (Qwen2-MoE's dense layers) are put on an axis over those
    # layers first, so that the optimizer's copies of them follow (layer_axis.py).
    state = dict(zip(_model_keys(trainer), compact_layer_keys([m.sharded_state_dict() for m in trainer.modules])))
    model_sd = dict(state)
    if trainer.optimizer is None or not with_optimizer:  # (describing it for loading initialises its state)
        return state
    fresh = []
    if is_loading:
        for opt in _chain(trainer.optimizer):
            # A distributed optimizer that never stepped has no 'step' to describe its state: give it
            # dummy state for the description, then drop it again so that loading allocates its own.
            if describe_fresh_state(opt):
                fresh.append(opt)
    # 'fully_reshardable': the distributed optimizer's state is stored per parameter in the
    # canonical layout, so it reshards across TP/PP/EP/DP (the default reshards over DP only).
    state["optimizer"] = trainer.optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    for opt in fresh:
        opt.optimizer.state.clear()
    return state


def save_checkpoint(trainer, path: str | Path) -> Path:
    """Write model and optimizer of every rank to ``path`` (a directory); all ranks must call it."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_sharded(trainer, is_loading=False), str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        ps = trainer.ps  # the layout it was saved at (loading reshards to any): for inspect_checkpoint
        layout = {k: getattr(ps, k) for k in ("world_size", "tp", "pp", "vpp", "ep", "etp", "dp", "sequence_parallel")}
        layout["precision"] = getattr(trainer, "precision", "fp32")  # trainer.precision: what its optimizer state is
        if lora := getattr(trainer, "lora", None):  # (alpha is in no tensor: checked on loading from here)
            layout["lora"] = {"rank": lora.rank, "alpha": lora.alpha}
        (tmp / LAYOUT_FILE).write_text(json.dumps(layout) + "\n")
        old = path.with_name(path.name + ".old")
        if path.exists():  # never a moment without a complete checkpoint on disk
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def saved_lora(path: str | Path) -> dict:
    """The LoRA adapters a checkpoint directory was saved with (``{'rank': r, 'alpha': a}``), {} for none (or no
    layout file)."""
    try:
        return json.loads((Path(path) / LAYOUT_FILE).read_text()).get("lora") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def saved_precision(path: str | Path) -> str:
    """The ``trainer.precision`` a checkpoint directory was saved in ('fp32' for one saved before it was recorded:
    every earlier run was fp32); '' when the directory has no layout file."""
    try:
        return json.loads((Path(path) / LAYOUT_FILE).read_text()).get("precision", "fp32")
    except (OSError, ValueError, AttributeError):
        return ""


def readable_path(path: str | Path) -> Path:
    """``path``, or ``<path>.old`` when a save died between its two renames (``path`` missing)."""
    path, old = Path(path), Path(path).with_name(Path(path).name + ".old")
    return old if not path.exists() and (old / "metadata.json").is_file() else path


def load_checkpoint(trainer, path: str | Path, load_optimizer: bool = True) -> None:
    """Load ``path`` into this trainer, whatever layout saved it."""
    from megatron.core import dist_checkpointing

    path = readable_path(path)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path} is not a megatron dist checkpoint (no metadata.json)")
    patch_step_copy()
    saved = dist_checkpointing.load_tensors_metadata(str(path))
    saved_keys = set(saved) if load_optimizer else set()
    if load_optimizer and not any(_CHAIN.sub("", k).startswith("optimizer.") for k in saved_keys):
        # saved before its first optimizer step (a policy during the critic's warm-up, a run of train.steps=0): it
        # has no Adam state, and a fresh optimizer is exactly that state (asking for it was a KeyError)
        load_optimizer = False
    # (before the optimizer is described for loading: a refusal leaves the trainer as it was)
    _check_adapters(path, _sharded(trainer, is_loading=True, with_optimizer=False), saved,
                    getattr(trainer, "adapters", None))
    sharded = _sharded(trainer, is_loading=True, with_optimizer=load_optimizer)
    main_params_saved = True
    if load_optimizer and "optimizer" in sharded:
        _match_chain_prefixes(sharded["optimizer"], saved_keys)
        main_params_saved = not _drop_unsaved_main_params(sharded["optimizer"], saved_keys)
    state = dist_checkpointing.load(sharded, str(path))
    if not load_optimizer:  # megatron returns the optimizer's common (non-tensor) part even when not asked
        state.pop("optimizer", None)
    if "optimizer" in state:
        chain = _chain(trainer.optimizer)
        if hasattr(chain[0], "gbuf_ranges"):  # distributed optimizer(s) here
            _align_chain(state["optimizer"], trainer.optimizer)
        else:
            _fill_param_groups(state["optimizer"], trainer.optimizer)
    for key, m in zip(_model_keys(trainer), trainer.modules):
        m.load_state_dict(state[key])
    if trainer.optimizer is not None and not load_optimizer:  # its main params from the weights just loaded (with
        for opt in _chain(trainer.optimizer):  # bf16 params, the optimizer's own fp32 copies: else the initial ones)
            opt.reload_model_params()
    if "optimizer" in state:
        trainer.optimizer.load_state_dict(state["optimizer"])
        untie_adam_steps(_chain(trainer.optimizer))
        if not main_params_saved:  # main params from the model weights just loaded
            for opt in _chain(trainer.optimizer):
                opt.reload_model_params()


def load_model_weights(modules: list[torch.nn.Module], path: str | Path, skip: tuple[str, ...] = ()) -> None:
    """A model's weights alone from the dist checkpoint ``path`` into this rank's chunks (``modules``), resharded to
    this rank's layout (``model.path`` set to ``tools/convert_checkpoint.py hf-to-mcore``'s output, or to a run's
    ``policy/``); ``skip``: parameter prefixes left as built (the critic's value head). A tensor the checkpoint
    lacks is an error naming the checkpoint and the tensors."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    path = readable_path(path)
    keys = _chunk_keys(modules)
    state = {key: {n: v for n, v in sd.items() if not n.startswith(skip)}
             for key, sd in zip(keys, compact_layer_keys([m.sharded_state_dict() for m in modules]))}
    saved = set(dist_checkpointing.load_tensors_metadata(str(path)))
    wanted = {v.key for v in nested_values(state) if isinstance(v, ShardedTensor)}
    if not any(".lora." in k for k in wanted) and (lora := _saved_adapter_keys(saved)):
        raise ValueError(f"{path}: a LoRA run's checkpoint (adapters such as {lora[0]}, {len(lora)} tensors): its base "
                         "weights alone would drop them; resume that run from it instead")
    if missing := sorted(wanted - saved):
        raise KeyError(f"{path}: the dist checkpoint has no tensors for {missing[:5]} ({len(missing)} missing): it "
                       "holds another model than config.json describes, or was cut short")
    loaded = dist_checkpointing.load(state, str(path))
    for key, m in zip(keys, modules):
        result = m.load_state_dict(loaded[key], strict=False)
        unset = [n for n in result.missing_keys if not n.startswith(skip) and not n.endswith("_extra_state")]
        if unset:
            raise KeyError(f"{path}: no weights for parameters {unset[:5]}")


def _saved_adapter_keys(saved_keys) -> list[str]:
    """The model's LoRA adapter tensors among a checkpoint's keys (not the optimizer's copies of them)."""
    return sorted(k for k in saved_keys if ".lora." in k and not _CHAIN.sub("", k).startswith("optimizer."))


def _check_adapters(path: Path, model_sds: dict, saved: dict, adapters) -> None:
    """Refuse a checkpoint whose LoRA adapters are not this trainer's, naming what differs: adapters saved and none
    here (a load would be the base alone) or the reverse, other targets, another rank or alpha."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    wanted = {v.key for v in nested_values(model_sds)
              if isinstance(v, (ShardedTensor, ShardedTensorFactory)) and ".lora." in v.key}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:  # every rank's (a pipeline
        every: list = [None] * dist.get_world_size()  # stage may lack a key: dense layers) and one verdict on all
        dist.all_gather_object(every, sorted(wanted))
        wanted = set().union(*every)
    have = _saved_adapter_keys(saved)
    rank = {saved[k].global_shape[-2] for k in have if k.endswith(".lora.a")}
    if have and not wanted:
        raise ValueError(f"{path} holds LoRA adapters (rank {', '.join(map(str, sorted(rank)))}: {len(have)} tensors "
                         f"such as {have[0]}) and this trainer has none: resume it with the lora settings it was "
                         "saved with (loading its base alone would drop the adapters)")
    if wanted and not have:
        raise ValueError(f"{path} holds no LoRA adapters (saved without lora) and this trainer has {len(wanted)} "
                         f"tensors of them (such as {min(wanted)}): resume it with lora.rank=0, or start a LoRA run "
                         "from its weights (model.path)")
    if wanted != set(have):
        only_saved, only_here = sorted(set(have) - wanted), sorted(wanted - set(have))
        raise ValueError(f"{path}: its LoRA adapters are on other layers than this trainer's (lora.targets): only in "
                         f"the checkpoint {only_saved[:4]}, only here {only_here[:4]}")
    if not adapters:
        return
    here = adapters[0].a.shape[0]
    if rank and rank != {here}:
        raise ValueError(f"{path}: lora.rank {', '.join(map(str, sorted(rank)))} in the checkpoint, {here} here")
    alpha = saved_lora(path).get("alpha")
    if alpha is not None and abs(alpha - adapters[0].scale * here) > 1e-6 * abs(alpha):
        raise ValueError(f"{path}: lora.alpha {alpha:g} in the checkpoint, {adapters[0].scale * here:g} here")


def _drop_unsaved_main_params(optimizer_sd: dict, saved_keys: set[str]) -> bool:
    """A distributed optimizer asks for its fp32 main params (``optimizer.state.param.*``); a plain
    optimizer's checkpoint has none (its main params are the model's). Drop those requests — the
    main params are then reloaded from the model weights — and say whether any were dropped."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    dropped = False
    for key, value in list(optimizer_sd.items()):
        if isinstance(value, dict):
            dropped |= _drop_unsaved_main_params(value, saved_keys)
        elif (isinstance(value, (ShardedTensor, ShardedTensorFactory)) and value.key not in saved_keys
              and ".state.param." in value.key):
            del optimizer_sd[key]
            dropped = True
    return dropped


_CHAIN = re.compile(r"^chained_\d+\.")


def _match_chain_prefixes(optimizer_sd: dict, saved_keys: set[str]) -> None:
    """Rename requested optimizer tensors whose key was saved under another ``chained_<i>.`` prefix."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    by_bare: dict[str, list[str]] = {}
    for key in saved_keys:
        by_bare.setdefault(_CHAIN.sub("", key), []).append(key)
    for value in nested_values(optimizer_sd):
        # Expert weights of SequentialMLP come as factories that build their ShardedTensors later.
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and value.key not in saved_keys:
            candidates = by_bare.get(_CHAIN.sub("", value.key), [])
            if len(candidates) == 1:
                value.key = candidates[0]


def _align_chain(loaded: dict, optimizer) -> None:
    """Make the saved optimizer groups fit this layout's chain of (distributed) optimizers.

    With MoE, megatron builds a ``ChainedOptimizer`` (dense and expert parts, integer keys in the
    state dict) when expert and dense parameters have different data-parallel groups (EP > 1),
    and a single optimizer otherwise. The sharded tensors were already matched by key
    (``_match_chain_prefixes``); the common state (param groups with Adam's step) is regrouped
    here: merged into one optimizer, or split over the chain by each group's identity. A plain
    optimizer's checkpoint (DP = 1) keeps its groups at the top and Adam's step as ``common_step``:
    it is first put in the distributed optimizer's form.
    """
    chain = _chain(optimizer)
    if "optimizer" not in loaded and "param_groups" in loaded:  # saved by a plain (torch) optimizer
        step = _saved_step(loaded)
        loaded.pop("state", None)
        groups = loaded.pop("param_groups")
        loaded["optimizer"] = {"param_groups": [g if step is None else {**g, "step": float(step)} for g in groups]}
        loaded.setdefault("param_state_sharding_type", "fully_reshardable")
    parts = [loaded[k] for k in sorted(k for k in loaded if isinstance(k, int))]
    if len(chain) == 1 and parts:  # saved chained, loading into one optimizer: merge
        saved_groups = [g for part in parts for g in part["optimizer"]["param_groups"]]
        loaded["optimizer"] = {**parts[0]["optimizer"], "param_groups": saved_groups}
        loaded["param_state_sharding_type"] = parts[0]["param_state_sharding_type"]
        for key in [k for k in loaded if isinstance(k, int)]:
            del loaded[key]
    elif len(chain) > 1 and "optimizer" in loaded:  # saved as one, loading into a chain: split
        saved_groups = loaded.pop("optimizer")["param_groups"]
        sharding = loaded.pop("param_state_sharding_type")
        for i, opt in enumerate(chain):
            part = loaded.setdefault(i, {})
            part["optimizer"] = {"param_groups": [_saved_group_for(g, saved_groups) for g in opt.param_groups]}
            part["param_state_sharding_type"] = sharding


def _group_identity(group: dict) -> tuple:
    """What tells megatron's param groups apart (wd/lr multipliers, expert flag, decoupled lr)."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys as ident_keys

    return tuple(group.get(k, group.get(f"pre_{k}")) for k in ident_keys)


def _saved_group_for(group: dict, saved_groups: list[dict]) -> dict:
    """The saved param group for this running one: the same identity, or — saved where experts
    were not parallel (EP = 1), so not flagged — the same identity but the expert flag; carried
    over under the running group's identity."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys as ident_keys

    want = _group_identity(group)
    loose = [i for i, k in enumerate(ident_keys) if k != "is_expert_parallel"]
    for exact in (True, False):
        for saved in saved_groups:
            have = _group_identity(saved)
            if have == want or (not exact and all(have[i] == want[i] for i in loose)):
                return {**saved, **dict(zip(ident_keys, want))}
    raise KeyError(f"checkpoint has no optimizer param group like {dict(zip(ident_keys, want))}")


def _fill_param_groups(loaded: dict, optimizer) -> None:
    """Loading into plain optimizer(s) (DP = 1; a chain of them when experts reduce apart) merges in
    the saver's common state — ``optimizer`` / ``common_step`` / integer keys of a chain — next to
    what was asked for, and the param groups carry only their ``params``. Keep what was asked for,
    give each parameter Adam's ``step`` as saved (the distributed optimizer keeps it per group, the
    plain one as ``common_step``, torch's Adam per parameter) and take the group hyper-parameters
    (lr/wd multipliers, expert flags) from the running optimizer."""
    chain = _chain(optimizer)
    if "param_groups" not in loaded and len(chain) == 1:
        return
    step = _saved_step(loaded)
    ours = set(range(len(chain))) if len(chain) > 1 else {"state", "param_groups"}
    for key in [k for k in loaded if k not in ours]:
        del loaded[key]
    parts = [loaded[i] for i in range(len(chain))] if len(chain) > 1 else [loaded]
    for part, opt in zip(parts, chain):
        states = part.setdefault("state", {})
        states.pop("common_step", None)
        if step is not None:
            for param_state in states.values():
                param_state.setdefault("step", torch.tensor(step))
        for group, runtime in zip(part["param_groups"], opt.param_groups):
            for key, value in runtime.items():
                if key != "params":
                    group.setdefault(key, value)


def _saved_step(loaded: dict) -> float | None:
    """Adam's step as the saver kept it, wherever its layout put it."""
    parts = [loaded] + [v for k, v in loaded.items() if isinstance(k, int)]
    steps = [float(p["state"]["common_step"]) for p in parts if "common_step" in p.get("state", {})]
    steps += [float(g["step"]) for p in parts for g in p.get("optimizer", {}).get("param_groups", [])
              if isinstance(g, dict) and "step" in g]
    return max(steps) if steps else None
