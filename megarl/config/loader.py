"""Strict YAML → ``RunConfig``: unknown keys and wrong types are errors naming the key and file.

Overrides are ``a.b.c=value`` strings; the value is read as YAML (``lr=3e-4``,
``sequence_parallel=true``). ``validate`` checks cross-field constraints (the
parallel layout against the world size and the model's shape) before anything
is launched.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import yaml

from megarl.config.algo_checks import validate_algo
from megarl.config.errors import ConfigError
from megarl.config.layouts import divisors, expert_layout_error, validate_replica_nodes
from megarl.config.limits import check_engine_head_size, check_engine_sizes, check_ranges, cuda_available
from megarl.config.presets import apply_layers
from megarl.config.schema import TINY_FAMILIES, RunConfig
from megarl.models.hf_config import check_sequence_length, num_experts


class _Loader(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, where ``3e-4`` is a string; read it as the float it means (YAML 1.2)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"),
    list("-+0123456789."),
)


def _yaml(text: str, source: str = ""):
    """Parse ``text``; a key given twice in one mapping is an error naming ``source``, the line and the key."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _no_duplicate_keys(node, source or "YAML")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _no_duplicate_keys(node, source: str, prefix: str = "") -> None:
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _no_duplicate_keys(item, source, prefix)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key, value in node.value:
        name = str(key.value) if isinstance(key, yaml.ScalarNode) else ""
        if name and name != "<<":
            line = key.start_mark.line + 1
            if name in seen:
                raise ConfigError(f"{source} line {line}: duplicate key '{prefix}{name}' (first given on line "
                                  f"{seen[name]}); keep one")
            seen[name] = line
        _no_duplicate_keys(value, source, f"{prefix}{name}.")


def _type_ok(value, typ) -> bool:
    if typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typ)


def _apply(obj, data: dict, source: str, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: '{prefix.rstrip('.') or '<top>'}' must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in data.items():
        dotted = prefix + str(key)
        if key not in names:
            raise ConfigError(f"{source}: unknown key '{dotted}'; valid keys here: {', '.join(sorted(names))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _apply(current, value, source, dotted + ".")
            continue
        typ = hints[key]
        if not _type_ok(value, typ):
            raise ConfigError(
                f"{source}: '{dotted}' must be {typ.__name__}, got {value!r} ({type(value).__name__})"
            )
        setattr(obj, key, float(value) if typ is float else value)


def parse_override(text: str) -> dict:
    """``'a.b.c=value'`` → ``{'a': {'b': {'c': value}}}`` with the value parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY.PATH=VALUE, e.g. optim.lr=3e-4")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key part in {key!r}")
    try:
        value = _yaml(raw, f"override {text!r}") if raw != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from None
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Defaults, then the YAML file, then each override in order; an ``algo.preset`` applies where it is given
    (``presets.apply_layers``: it replaces the algo keys of earlier layers, later keys win over it)."""
    data = None
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = _yaml(path.read_text(), str(path)) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    layers = ([(data, str(path))] if data is not None else []) + [
        (parse_override(text), f"override {text!r}") for text in overrides]
    return apply_layers(RunConfig(), layers, _apply)


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)




MAX_OVERSUBSCRIPTION = 64.0
"""The most live groups per update group: with ``rollout.staleness_limit`` k a group admitted more than k + 1 update
batches ahead is stale before it trains; 64 leaves room for any limit in use (1e9 admitted without end)."""


def validate(cfg: RunConfig, world_size: int, hf_config: dict | None = None, here: bool = True) -> None:
    """Cross-field checks; raises ConfigError naming the key and suggesting valid values. ``here``: the run's
    engines are on this machine (``megarl plan`` sizes a cluster from a login node: it is not)."""
    p = cfg.parallel
    for key in ("tp", "pp", "vpp", "ep"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key} must be >= 1, got {getattr(p, key)}")
    if p.etp < 0:
        raise ConfigError(f"parallel.etp must be >= 0 (0: same as tp), got {p.etp}")
    if world_size % (p.tp * p.pp):
        raise ConfigError(
            f"parallel.tp × parallel.pp = {p.tp}×{p.pp} must divide the world size {world_size}; "
            f"valid tp×pp products: {divisors(world_size)}"
        )
    dp = world_size // (p.tp * p.pp)
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1")
    if p.moe_dispatcher not in ("alltoall", "allgather"):
        raise ConfigError(f"parallel.moe_dispatcher must be 'alltoall' or 'allgather', got {p.moe_dispatcher!r}")
    etp = p.etp or p.tp
    if (p.ep * etp) > 1 and (dp * p.tp) % (p.ep * etp):
        raise ConfigError(expert_layout_error(p, dp, num_experts(hf_config) if hf_config else 0))
    if cfg.engine.placement == "colocated" and (cfg.engine.tensor_parallel_size < 1 or
                                                world_size % cfg.engine.tensor_parallel_size):
        raise ConfigError(  # world/TP colocated replicas (megarl/engines/colocated.py); TP = world: one engine
            f"engine.tensor_parallel_size={cfg.engine.tensor_parallel_size} must divide the world size {world_size} "
            f"(colocated placement: world/TP engine replicas); valid: {divisors(world_size)}"
        )
    r = cfg.rollout
    if r.samples_per_prompt < 2:
        raise ConfigError(f"rollout.samples_per_prompt must be >= 2 for group baselines, got {r.samples_per_prompt}")
    if r.prompts_per_step < 1 or r.max_new_tokens < 1:
        raise ConfigError("rollout.prompts_per_step and rollout.max_new_tokens must be >= 1")
    if r.mode not in ("sync", "on_policy", "partial"):
        raise ConfigError(f"rollout.mode must be 'sync', 'on_policy' or 'partial', got {r.mode!r}")
    if r.mode != "sync" and not 1.0 <= r.oversubscription <= MAX_OVERSUBSCRIPTION:
        raise ConfigError(f"rollout.oversubscription must be in [1.0, {MAX_OVERSUBSCRIPTION:g}] (live groups per update "
                          f"group: more update batches in flight than that only go stale), got {r.oversubscription}")
    if r.stale_action not in ("regenerate", "drop"):
        raise ConfigError(f"rollout.stale_action must be 'regenerate' or 'drop', got {r.stale_action!r}")
    if r.dispatch not in ("pull", "lpt"):
        raise ConfigError(f"rollout.dispatch must be 'pull' or 'lpt', got {r.dispatch!r}")
    if r.staleness_limit < 0:
        raise ConfigError(f"rollout.staleness_limit must be >= 0, got {r.staleness_limit}")
    if r.max_discards < 1:
        raise ConfigError(f"rollout.max_discards must be >= 1, got {r.max_discards}")
    if r.max_update_groups and r.max_update_groups < r.prompts_per_step:
        raise ConfigError(f"rollout.max_update_groups must be 0 or >= rollout.prompts_per_step ({r.prompts_per_step}), "
                          f"got {r.max_update_groups}")
    if r.buffer_samples < 0:
        raise ConfigError(f"rollout.buffer_samples must be >= 0 (0: no bound), got {r.buffer_samples}")
    if r.long_round_groups < 0:
        raise ConfigError(f"rollout.long_round_groups must be >= 0 (0: rollout.prompts_per_step), got {r.long_round_groups}")
    if cfg.optim.lr_decay not in ("constant", "cosine"):
        raise ConfigError(f"optim.lr_decay must be 'constant' or 'cosine', got {cfg.optim.lr_decay!r}")
    if cfg.engine.slots < 1:
        raise ConfigError(f"engine.slots must be >= 1, got {cfg.engine.slots}")
    if r.temperature <= 0:
        raise ConfigError(f"rollout.temperature must be > 0, got {r.temperature}")
    if cfg.sync.bucket_mib <= 0:
        raise ConfigError(f"sync.bucket_mib must be > 0 (e.g. 64), got {cfg.sync.bucket_mib}")
    e = cfg.engine
    if e.placement not in ("colocated", "disaggregated"):
        raise ConfigError(f"engine.placement must be 'colocated' or 'disaggregated', got {e.placement!r}")
    if e.replicas < 1 or (e.replicas > 1 and e.placement != "disaggregated"):
        raise ConfigError(f"engine.replicas={e.replicas}: must be >= 1, and > 1 only with engine.placement=disaggregated")
    if cfg.sync.transport not in ("gloo", "nccl"):
        raise ConfigError(f"sync.transport must be 'gloo' or 'nccl', got {cfg.sync.transport!r}")
    if cfg.sync.transport == "nccl" and e.placement != "disaggregated":
        raise ConfigError("sync.transport=nccl applies to engine.placement=disaggregated (colocated engines load "
                          "in place); set sync.transport=gloo or engine.placement=disaggregated")
    if cfg.sync.transport == "nccl" and not cuda_available():
        raise ConfigError("sync.transport=nccl needs CUDA on the trainer and the engines (torch.cuda.is_available() "
                          "is False here); use sync.transport=gloo")
    validate_replica_nodes(e)
    devices = [d for d in e.replica_devices.split(",") if d.strip()]
    per_node = e.replicas // max(1, e.replica_nodes) * e.tensor_parallel_size
    if e.placement == "disaggregated" and cuda_available() and len(devices) != per_node:
        raise ConfigError(f"engine.replica_devices={e.replica_devices!r}: disaggregated replicas on GPUs need "
                          f"(engine.replicas / hosting nodes) × engine.tensor_parallel_size = {per_node} "
                          "CUDA device ids of each hosting node, apart from the trainer's (e.g. '4,5,6,7')")
    if devices and e.placement != "disaggregated":
        raise ConfigError(f"engine.replica_devices={e.replica_devices!r} places disaggregated replicas; colocated "
                          "engines run on their trainer rank's own device: leave it empty or set "
                          "engine.placement=disaggregated")
    if devices and not cuda_available():
        raise ConfigError(f"engine.replica_devices={e.replica_devices!r} names CUDA devices, but CUDA is absent here; "
                          "leave it empty (replicas are plain processes on CPU)")
    if cfg.sync.rollback not in ("copy", "resync"):
        raise ConfigError(f"sync.rollback must be 'copy' (back up the engine's weights before each load) or "
                          f"'resync' (no backup; a failed load makes the engine re-sync), got {cfg.sync.rollback!r}")
    if cfg.sync.timeout_s <= 0:
        raise ConfigError(f"sync.timeout_s must be > 0 seconds (e.g. 300), got {cfg.sync.timeout_s}")
    if e.placement == "disaggregated" and e.sleep_level:
        raise ConfigError("engine.sleep_level applies to colocated engines; set it to 0 with disaggregated placement")
    if cfg.engine.sleep_level not in (0, 1, 2):
        raise ConfigError(f"engine.sleep_level must be 0, 1 or 2, got {cfg.engine.sleep_level}")
    if cfg.sync.check_every < 0:
        raise ConfigError(f"sync.check_every must be >= 0 (0: never; N: audit every N syncs), got {cfg.sync.check_every}")
    validate_algo(cfg)
    _validate_train(cfg)
    _validate_fp8(cfg.model.fp8)
    if cfg.model.transformer_engine and (why := transformer_engine_error()) is not None:
        raise ConfigError(f"model.transformer_engine=true needs Transformer Engine on a GPU, which is not "
                          f"importable here ({why}); set model.transformer_engine=false")
    if cfg.model.make_tiny not in ("", *TINY_FAMILIES):
        raise ConfigError(f"model.make_tiny must be '' or one of {', '.join(TINY_FAMILIES)}, got {cfg.model.make_tiny!r}")
    _validate_data_reward_eval(cfg)
    check_ranges(cfg)
    check_engine_sizes(cfg)
    if hf_config is not None:
        _validate_against_model(cfg, hf_config, here)


def _validate_against_model(cfg: RunConfig, hf: dict, here: bool = True) -> None:
    p = cfg.parallel
    heads, kv, layers = hf["num_attention_heads"], hf["num_key_value_heads"], hf["num_hidden_layers"]
    experts = num_experts(hf)
    if heads % p.tp or kv % p.tp:
        valid = [d for d in divisors(kv) if heads % d == 0]
        raise ConfigError(
            f"parallel.tp={p.tp} must divide attention heads ({heads}) and KV heads ({kv}); valid: {valid}"
        )
    if layers % p.pp:
        raise ConfigError(f"parallel.pp={p.pp} must divide the number of layers ({layers}); valid: {divisors(layers)}")
    if p.vpp > 1 and p.pp == 1:
        raise ConfigError(f"parallel.vpp={p.vpp} needs parallel.pp > 1 (virtual stages interleave pipeline ranks)")
    if layers % (p.pp * p.vpp):
        raise ConfigError(f"parallel.vpp={p.vpp}: pp × vpp = {p.pp * p.vpp} must divide the number of layers "
                          f"({layers}); valid vpp: {divisors(layers // p.pp)}")
    if p.ep > 1 and not experts:
        raise ConfigError(f"parallel.ep={p.ep} needs an MoE model; {cfg.model.path} is dense")
    if experts and p.tp > 1 and not p.sequence_parallel:
        raise ConfigError(f"parallel.tp={p.tp} on an MoE model needs parallel.sequence_parallel=true "
                          "(megatron-core refuses MoE + TP without it)")
    if experts and experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide the number of experts ({experts}); valid: {divisors(experts)}")
    if hf["vocab_size"] % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} must divide the vocabulary size ({hf['vocab_size']})")
    if cfg.engine.max_model_len > hf.get("max_position_embeddings", cfg.engine.max_model_len):
        raise ConfigError(
            f"engine.max_model_len={cfg.engine.max_model_len} exceeds the model's "
            f"max_position_embeddings ({hf['max_position_embeddings']})"
        )
    try:
        check_sequence_length(hf, cfg.engine.max_model_len, f"{cfg.model.path}/config.json")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if here:  # (the attention backends of this machine's vLLM build)
        check_engine_head_size(hf, f"{cfg.model.path}/config.json")


def validate_resume_model(cfg: RunConfig, hf: dict) -> None:
    """``train``, before launch: the checkpoint ``train.resume`` continues from holds ``model.path``'s
    architecture (``checkpoint/identity.py``); ConfigError naming both models otherwise."""
    from megarl.checkpoint.identity import ModelMismatch, check_same_model
    from megarl.checkpoint.run import resume_candidate

    step = resume_candidate(cfg.train.resume, cfg.train.run_dir)
    if step is None or not (step / "policy" / "metadata.json").is_file():
        return  # nothing to resume, or an incomplete save (the resume itself warns and takes the previous one)
    try:
        check_same_model(step / "policy", hf, f"model.path={cfg.model.path}")
    except ModelMismatch as exc:
        auto = cfg.train.resume == "auto"
        raise ConfigError(f"train.resume={cfg.train.resume}{f' in train.run_dir={cfg.train.run_dir}' if auto else ''}: "
                          f"{exc}{' (train.resume=never starts afresh, setting that run aside)' if auto else ''}") from None
    except (OSError, EOFError, RuntimeError):
        return  # an unreadable checkpoint: the resume verifies it and names the problem


def _validate_data_reward_eval(cfg: RunConfig) -> None:
    """data.*, reward.*, eval.* values (the dataset files themselves: ``megarl.data.checks.check_data``)."""
    d, r = cfg.data, cfg.reward
    if d.task != "addition":
        raise ConfigError(f"data.task {d.task!r} is not known; valid: 'addition' (or set data.path to a dataset)")
    if d.on_bad_row not in ("skip", "error"):
        raise ConfigError(f"data.on_bad_row must be 'skip' or 'error', got {d.on_bad_row!r}")
    if d.max_prompt_tokens < 0 or d.eval_size < 0:
        raise ConfigError("data.max_prompt_tokens and data.eval_size must be >= 0")
    if d.path and (cfg.warmup.steps or d.pool_size):
        raise ConfigError("warmup.steps and data.pool_size work with the built-in task only (they need its "
                          f"reference responses / problem pool); set them to 0 with data.path={d.path!r}")
    if d.path and not r.fn:
        raise ConfigError("reward.fn must be set with data.path: 'math', 'exact', 'addition' or 'package.module:function'")
    if r.fn and ":" not in r.fn and r.fn not in ("math", "exact", "addition"):
        raise ConfigError(f"reward.fn {r.fn!r} is not known; valid: 'math', 'exact', 'addition' or 'package.module:function'")
    if r.workers < 1 or r.timeout_s <= 0:
        raise ConfigError(f"reward.workers must be >= 1 and reward.timeout_s > 0, got {r.workers} and {r.timeout_s}")
    if r.max_failed_steps < 0:
        raise ConfigError(f"reward.max_failed_steps must be >= 0 (0: never stop), got {r.max_failed_steps}")
    if r.format_coef and ":" in r.fn:
        raise ConfigError("reward.format_coef applies to the built-in rewards; fold the format term into your function")
    if ":" in r.fn:  # the module imports as every rank will import it (working directory, PYTHONPATH)
        from megarl.rewards.base import import_reward_fn

        try:
            import_reward_fn(r.fn)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if cfg.eval.samples < 1 or cfg.eval.temperature <= 0:
        raise ConfigError(f"eval.samples must be >= 1 and eval.temperature > 0, got {cfg.eval.samples}, "
                          f"{cfg.eval.temperature}")


def _validate_train(cfg: RunConfig) -> None:
    """Checkpoint, resume and fault keys (``train.*``, ``engine.max_restarts``, ``engine.hang_timeout_s``, ``engine.peer_wait_s``)."""
    t = cfg.train
    for key in ("save_every", "max_bad_steps"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key} must be >= 0, got {getattr(t, key)}")
    if t.keep_checkpoints < 1:
        raise ConfigError(f"train.keep_checkpoints must be >= 1, got {t.keep_checkpoints}")
    if cfg.engine.max_restarts < 0:
        raise ConfigError(f"engine.max_restarts must be >= 0, got {cfg.engine.max_restarts}")
    if cfg.engine.hang_timeout_s < 0:
        raise ConfigError(f"engine.hang_timeout_s must be >= 0 seconds (0 turns the hang watchdog off), "
                          f"got {cfg.engine.hang_timeout_s}")
    if cfg.engine.peer_wait_s <= 0:
        raise ConfigError(f"engine.peer_wait_s must be > 0 seconds, got {cfg.engine.peer_wait_s}")
    if t.resume not in ("auto", "never") and not Path(t.resume).is_dir():
        raise ConfigError(f"train.resume={t.resume!r}: expected 'auto', 'never' or an existing checkpoint directory "
                          "(run_dir/checkpoints/step_N)")
    if t.resume not in ("auto", "never"):
        from megarl.checkpoint.run import step_dir_problem

        if problem := step_dir_problem(t.resume):
            raise ConfigError(f"train.resume={t.resume}: {problem}")
    if t.deterministic and t.time_limit_s:
        raise ConfigError(f"train.deterministic=true needs train.time_limit_s=0 (got {t.time_limit_s}): a wall-clock "
                          "limit stops runs at different steps")


FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def transformer_engine_error() -> str | None:
    """Why Transformer Engine cannot be used here, or None when it can."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # ImportError, or a broken CUDA install raising at import
        return f"{type(exc).__name__}: {exc}"
    return None


def _validate_fp8(fp8: str) -> None:
    if not fp8:
        return
    if fp8 not in FP8_RECIPES:
        raise ConfigError(f"model.fp8 must be '' or one of {', '.join(FP8_RECIPES)}; got {fp8!r}")
    why = transformer_engine_error()
    if why is not None:
        raise ConfigError(f"model.fp8={fp8!r} needs Transformer Engine on a GPU, which is not importable here "
                          f"({why}); install megarl[gpu] on a CUDA machine or set model.fp8=''")
