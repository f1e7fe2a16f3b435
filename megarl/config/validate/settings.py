"""Each section's values on their own and against each other, before anything is launched.

``validate`` is the whole check of a config (the others in this package are its parts); every failure is a
``ConfigError`` naming the key, its value and what would be valid. Choice-valued keys are refused by their type
when loaded (``loader.check_choices``); the layout's rules are ``layout.py``'s, the model's ``model.py``'s.
"""

from __future__ import annotations

from pathlib import Path

from megarl.config.errors import ConfigError
from megarl.config.loader import check_choices
from megarl.config.schema import RunConfig
from megarl.config.validate.algo import validate_algo
from megarl.config.validate.layout import check_world_layout, replica_device_ids, validate_replica_nodes
from megarl.config.validate.limits import check_engine_sizes, check_microbatch_tokens, check_ranges, cuda_available
from megarl.config.validate.lora import validate_lora
from megarl.config.validate.model import check_model_fits

MAX_OVERSUBSCRIPTION = 64.0
"""The most live groups per update group: with ``rollout.staleness_limit`` k a group admitted more than k + 1 update
batches ahead is stale before it trains; 64 leaves room for any limit in use (1e9 admitted without end)."""

FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def validate(cfg: RunConfig, world_size: int, hf_config: dict | None = None, here: bool = True) -> None:
    """Every check of ``cfg`` at ``world_size`` processes (and of the model's ``hf_config`` when given); raises
    ConfigError naming the key and suggesting valid values. ``here``: the run's engines are on this machine
    (``megarl plan`` sizes a cluster from a login node: it is not)."""
    check_choices(cfg)
    check_world_layout(cfg, world_size, hf_config)
    _validate_rollout(cfg)
    _validate_engine_and_sync(cfg, here)
    validate_algo(cfg)
    _validate_train(cfg)
    _validate_model_keys(cfg)
    _validate_data_reward_eval(cfg)
    _validate_env(cfg)
    check_ranges(cfg)
    check_engine_sizes(cfg)
    check_microbatch_tokens(cfg)
    validate_lora(cfg, hf_config)
    if hf_config is not None:
        check_model_fits(cfg, hf_config, here)


def _validate_rollout(cfg: RunConfig) -> None:
    r = cfg.rollout
    if r.samples_per_prompt < 2:
        raise ConfigError(f"rollout.samples_per_prompt must be >= 2 for group baselines, got {r.samples_per_prompt}")
    if r.prompts_per_step < 1 or r.max_new_tokens < 1:
        raise ConfigError("rollout.prompts_per_step and rollout.max_new_tokens must be >= 1")
    if r.mode != "sync" and not 1.0 <= r.oversubscription <= MAX_OVERSUBSCRIPTION:
        raise ConfigError(f"rollout.oversubscription must be in [1.0, {MAX_OVERSUBSCRIPTION:g}] "
                          f"(live groups per update group: more update batches in flight than that only go stale), "
                          f"got {r.oversubscription}")
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
        raise ConfigError(f"rollout.long_round_groups must be >= 0 (0: rollout.prompts_per_step), "
                          f"got {r.long_round_groups}")
    if r.temperature <= 0:
        raise ConfigError(f"rollout.temperature must be > 0, got {r.temperature}")
    if r.overlap != "none" and cfg.engine.placement != "disaggregated":
        raise ConfigError(f"rollout.overlap={r.overlap} needs engine.placement=disaggregated: colocated engines run in "
                          "the trainer's own processes (and on its devices), so generation and training cannot run at "
                          "once; set engine.placement=disaggregated or rollout.overlap=none")


def _validate_engine_and_sync(cfg: RunConfig, here: bool = True) -> None:
    """``here``: the engines run on this machine (its CUDA decides); else (``megarl plan`` on a login node) the GPUs
    are the cluster's: ``engine.replica_devices`` is checked when given, never refused for CUDA absent here."""
    e, s = cfg.engine, cfg.sync
    if e.slots < 1:
        raise ConfigError(f"engine.slots must be >= 1, got {e.slots}")
    if s.bucket_mib <= 0:
        raise ConfigError(f"sync.bucket_mib must be > 0 (e.g. 64), got {s.bucket_mib}")
    if e.replicas < 1 or (e.replicas > 1 and e.placement != "disaggregated"):
        raise ConfigError(f"engine.replicas={e.replicas}: must be >= 1, "
                          "and > 1 only with engine.placement=disaggregated")
    if s.transport == "nccl" and e.placement != "disaggregated":
        raise ConfigError("sync.transport=nccl applies to engine.placement=disaggregated (colocated engines load "
                          "in place); set sync.transport=gloo or engine.placement=disaggregated")
    if s.transport == "nccl" and not cuda_available():
        raise ConfigError("sync.transport=nccl needs CUDA on the trainer and the engines (torch.cuda.is_available() "
                          "is False here); use sync.transport=gloo")
    validate_replica_nodes(e)
    devices = replica_device_ids(e.replica_devices)
    per_node = e.replicas // max(1, e.replica_nodes) * e.tensor_parallel_size
    on_gpus = cuda_available() if here else bool(devices)
    if e.placement == "disaggregated" and on_gpus and len(devices) != per_node:
        raise ConfigError(f"engine.replica_devices={e.replica_devices!r}: disaggregated replicas on GPUs need "
                          f"(engine.replicas / hosting nodes) × engine.tensor_parallel_size = {per_node} "
                          "CUDA device ids of each hosting node, apart from the trainer's (e.g. '4,5,6,7')")
    if devices and e.placement != "disaggregated":
        raise ConfigError(f"engine.replica_devices={e.replica_devices!r} places disaggregated replicas; colocated "
                          "engines run on their trainer rank's own device: leave it empty or set "
                          "engine.placement=disaggregated")
    if devices and here and not cuda_available():
        raise ConfigError(f"engine.replica_devices={e.replica_devices!r} names CUDA devices, but CUDA is absent here; "
                          "leave it empty (replicas are plain processes on CPU)")
    if s.timeout_s <= 0:
        raise ConfigError(f"sync.timeout_s must be > 0 seconds (e.g. 300), got {s.timeout_s}")
    if not 0.0 <= e.gpu_memory_utilization < 1.0:
        raise ConfigError(f"engine.gpu_memory_utilization must be in [0, 1) (a share of each GPU; "
                          f"0: engine.kv_cache_gib sizes the KV cache), got {e.gpu_memory_utilization}")
    if e.enforce_eager is False and not cuda_available():
        raise ConfigError("engine.enforce_eager=false asks vLLM for CUDA graphs, and CUDA is absent here (vLLM's CPU "
                          "backend runs eager only); set engine.enforce_eager=auto")
    if e.placement == "disaggregated" and e.sleep_level:
        raise ConfigError("engine.sleep_level applies to colocated engines; set it to 0 with disaggregated placement")
    if s.check_every < 0:
        raise ConfigError(f"sync.check_every must be >= 0 (0: never; N: audit every N syncs), got {s.check_every}")


def _validate_data_reward_eval(cfg: RunConfig) -> None:
    """data.*, reward.*, eval.* values (the dataset files themselves: ``megarl.data.checks.check_data``; the reward
    function's import and signature: ``prelaunch``)."""
    d, r = cfg.data, cfg.reward
    if d.max_prompt_tokens < 0 or d.eval_size < 0:
        raise ConfigError("data.max_prompt_tokens and data.eval_size must be >= 0")
    if d.path and d.pool_size:
        raise ConfigError("data.pool_size works with the built-in task only (it needs its problem pool); set it to 0 "
                          f"with data.path={d.path!r}")
    if d.path and cfg.warmup.steps and not cfg.warmup.path:
        raise ConfigError(f"warmup.steps={cfg.warmup.steps} with data.path={d.path!r} needs warmup.path, a file of "
                          "reference conversations ({\"messages\": [...]} rows; the built-in task's references serve "
                          "only without data.path), or warmup.steps=0")
    if cfg.warmup.path and not cfg.warmup.steps:
        raise ConfigError(f"warmup.path={cfg.warmup.path!r} is read by the warm-up: set warmup.steps > 0 "
                          "(or warmup.path='')")
    if d.path and not r.fn:
        raise ConfigError("reward.fn must be set with data.path: "
                          "'math', 'exact', 'addition' or 'package.module:function'")
    if r.fn and ":" not in r.fn and r.fn not in ("math", "exact", "addition"):
        raise ConfigError(f"reward.fn {r.fn!r} is not known; "
                          "valid: 'math', 'exact', 'addition' or 'package.module:function'")
    if r.workers < 1 or r.timeout_s <= 0:
        raise ConfigError(f"reward.workers must be >= 1 and reward.timeout_s > 0, got {r.workers} and {r.timeout_s}")
    if r.max_failed_steps < 0:
        raise ConfigError(f"reward.max_failed_steps must be >= 0 (0: never stop), got {r.max_failed_steps}")
    if r.format_coef and ":" in r.fn:
        raise ConfigError("reward.format_coef applies to the built-in rewards; fold the format term into your function")
    if cfg.eval.samples < 1 or cfg.eval.temperature <= 0:
        raise ConfigError(f"eval.samples must be >= 1 and eval.temperature > 0, got {cfg.eval.samples}, "
                          f"{cfg.eval.temperature}")


def _validate_train(cfg: RunConfig) -> None:
    """Checkpoint, resume and fault keys (``train.*``, ``engine.max_restarts``, ``engine.hang_timeout_s``,
    ``engine.peer_wait_s``)."""
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
        from megarl.checkpoint.run import step_dir_problem  # deferred: torch (config errors stay instant)

        if problem := step_dir_problem(t.resume):
            raise ConfigError(f"train.resume={t.resume}: {problem}")
    if t.deterministic and t.time_limit_s:
        raise ConfigError(f"train.deterministic=true needs train.time_limit_s=0 (got {t.time_limit_s}): a wall-clock "
                          "limit stops runs at different steps")


def transformer_engine_error() -> str | None:
    """Why Transformer Engine cannot be used here, or None when it can."""
    try:
        import transformer_engine.pytorch  # noqa: F401  (deferred: a GPU-only package, asked only when wanted)
    except Exception as exc:  # ImportError, or a broken CUDA install raising at import
        return f"{type(exc).__name__}: {exc}"
    return None


def resolved_transformer_engine(cfg: RunConfig) -> bool:
    """``model.transformer_engine`` as the trainer applies it: 'auto' is on where CUDA and Transformer Engine are
    importable (a GPU machine with megarl[gpu]), off elsewhere (CPU) and under LoRA (adapters sit on megatron's
    own linears: ``trainer/lora.py``); true and false as given (true without them is refused before launch:
    ``validate``; with LoRA, true takes adapters on Transformer Engine's linears, its experts megatron's own
    SequentialMLP when adapted).
    Called once, by the session, before the trainers are built."""
    te = cfg.model.transformer_engine
    if te == "auto":
        return transformer_engine_planned(cfg, cuda_available()) and transformer_engine_error() is None
    return bool(te)


def transformer_engine_planned(cfg: RunConfig, gpu: bool) -> bool:
    """Whether the trainer runs Transformer Engine's layers on a machine with (``gpu``) or without GPUs, as
    ``resolved_transformer_engine`` resolves 'auto' there (Transformer Engine taken as installed with the GPUs);
    FP8 always runs them."""
    te = cfg.model.transformer_engine
    return bool(cfg.model.fp8) or te is True or (te == "auto" and gpu and cfg.lora.rank <= 0)


def _validate_model_keys(cfg: RunConfig) -> None:
    """``model.fp8`` and ``model.transformer_engine`` need Transformer Engine on a GPU."""
    m = cfg.model
    if m.fp8 and cfg.trainer.precision != "bf16":
        raise ConfigError(f"model.fp8={m.fp8!r} runs on megatron's bf16 mixed precision; set trainer.precision=bf16 "
                          f"(got {cfg.trainer.precision!r}) or model.fp8=''")
    if m.fp8 and cfg.trainer.reference_on_host:
        raise ConfigError(f"trainer.reference_on_host=true with model.fp8={m.fp8!r}: copying weights into FP8 layers "
                          "would leave their cached FP8 copies stale; set trainer.reference_on_host=false")
    if m.fp8 and (why := transformer_engine_error()) is not None:
        raise ConfigError(f"model.fp8={m.fp8!r} needs Transformer Engine on a GPU, which is not importable here "
                          f"({why}); install megarl[gpu] on a CUDA machine or set model.fp8=''")
    if m.transformer_engine is True and (why := transformer_engine_error()) is not None:
        raise ConfigError(f"model.transformer_engine=true needs Transformer Engine on a GPU, which is not "
                          f"importable here ({why}); set model.transformer_engine=auto (off without it) or false")
    if m.transformer_engine is True and not cuda_available():
        raise ConfigError("model.transformer_engine=true needs Transformer Engine on a GPU, and CUDA is absent here; "
                          "set model.transformer_engine=auto (off on CPU) or false")


def _validate_env(cfg: RunConfig) -> None:
    """``env.*`` values; the class itself is checked against the data by ``prelaunch.check_env``."""
    e = cfg.env
    if e.tools and e.fn != "tools":
        raise ConfigError(f"env.tools={e.tools!r} is read by the built-in tool environment: set env.fn=tools "
                          f"(env.fn={e.fn!r})")
    if not e.fn:
        return
    if ":" not in e.fn and e.fn != "tools":
        raise ConfigError(f"env.fn={e.fn!r}: expected a class as 'package.module:Class', or 'tools' (the built-in "
                          "tool environment)")
    if e.fn == "tools" and not e.tools:
        raise ConfigError("env.fn=tools needs env.tools: a comma-separated list of 'package.module:function'")
    if e.max_turns < 1:
        raise ConfigError(f"env.max_turns must be >= 1 (model turns per episode), got {e.max_turns}")
    if e.timeout_s <= 0 or e.workers < 1:
        raise ConfigError(f"env.timeout_s must be > 0 and env.workers >= 1, got {e.timeout_s} and {e.workers}")
