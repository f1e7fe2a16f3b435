"""Values torch or vLLM would refuse only after launch: numeric ranges, the engine's sizes against the prompt and
response lengths, the KV cache against this machine's memory, and the attention head sizes the installed vLLM runs.
``validate`` calls the config-only checks; ``megarl train``/``eval`` add the machine's memory
(``check_local_engine_memory``; not ``megarl plan``, which sizes other machines)."""

from __future__ import annotations

import importlib.util
import os

from megarl.config.errors import ConfigError
from megarl.config.schema import RolloutConfig, RunConfig, TrainerConfig


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def vllm_route_output_problem() -> str:
    """Why vLLM's route output (``enable_return_routed_experts``, ``engines/routes.py``) would be refused at the
    engine's start on this GPU machine ('' when it would not): it needs Model Runner V2, which needs Triton."""
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip() == "0":  # (vLLM reads it as bool(int(value)))
        return "needs vLLM's Model Runner V2, and VLLM_USE_V2_MODEL_RUNNER=0 in the environment forces V1: unset it"
    if importlib.util.find_spec("triton") is None:
        return "needs vLLM's Model Runner V2, which needs Triton: install triton (it comes with torch's CUDA wheels)"
    return ""


def check_ranges(cfg: RunConfig) -> None:
    """Numbers out of range in ``optim.*``, ``warmup.*``, ``train.*`` and ``rollout.*`` (``not x >= 0`` catches NaN)."""
    o, w, t, r = cfg.optim, cfg.warmup, cfg.train, cfg.rollout
    for key, value in (("optim.lr", o.lr), ("optim.min_lr", o.min_lr), ("optim.weight_decay", o.weight_decay),
                       ("optim.grad_clip", o.grad_clip), ("optim.lr_warmup_steps", o.lr_warmup_steps),
                       ("optim.moe_aux_loss_coeff", o.moe_aux_loss_coeff),
                       ("optim.moe_z_loss_coeff", o.moe_z_loss_coeff),
                       ("optim.logprob_chunk", o.logprob_chunk), ("warmup.lr", w.lr), ("warmup.steps", w.steps),
                       ("train.steps", t.steps), ("train.time_limit_s", t.time_limit_s),
                       ("train.eval_every", t.eval_every),
                       ("train.export_hf_every", t.export_hf_every), ("rollout.token_budget", r.token_budget)):
        if not value >= 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")
    for key, value in (("optim.adam_beta1", o.adam_beta1), ("optim.adam_beta2", o.adam_beta2)):
        if not 0 <= value < 1:
            raise ConfigError(f"{key} must be in [0, 1), got {value} (e.g. 0.9 and 0.999)")
    if o.lr_decay == "cosine" and o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr={o.min_lr} must be <= optim.lr={o.lr} (the cosine decays from lr to min_lr)")
    for key, value in (("optim.micro_batch_size", o.micro_batch_size), ("warmup.batch_size", w.batch_size),
                       ("trainer.recompute_layers", cfg.trainer.recompute_layers)):
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p must be in (0, 1], got {r.top_p}")
    if not t.export_shard_gib > 0:
        raise ConfigError(f"train.export_shard_gib must be > 0, got {t.export_shard_gib} (e.g. 5: files of 5 GiB)")


def check_engine_sizes(cfg: RunConfig) -> None:
    """``engine.max_model_len`` against the prompt and response lengths; ``engine.kv_cache_gib`` > 0."""
    e, d, r = cfg.engine, cfg.data, cfg.rollout
    if d.max_prompt_tokens and e.max_model_len < d.max_prompt_tokens + r.max_new_tokens:
        raise ConfigError(
            f"engine.max_model_len={e.max_model_len} < data.max_prompt_tokens ({d.max_prompt_tokens}) + "
            f"rollout.max_new_tokens ({r.max_new_tokens}) = {d.max_prompt_tokens + r.max_new_tokens}: a prompt the "
            "data admits would leave its response cut short or be refused by vLLM; raise engine.max_model_len or "
            "lower data.max_prompt_tokens / rollout.max_new_tokens")
    if e.max_model_len <= r.max_new_tokens:
        raise ConfigError(
            f"engine.max_model_len={e.max_model_len} must exceed rollout.max_new_tokens ({r.max_new_tokens}): "
            "prompts get max_model_len - max_new_tokens tokens (data.max_prompt_tokens=0), which leaves none")
    if not e.kv_cache_gib > 0:
        raise ConfigError(f"engine.kv_cache_gib must be > 0, got {e.kv_cache_gib}")


def check_microbatch_tokens(cfg: RunConfig) -> None:
    """``trainer.max_tokens_per_microbatch`` against packing and the longest row: a rollout's row feeds prompt +
    response less its last token (a label only), at most ``engine.max_model_len`` − 1 positions, and a row longer
    than the budget fits in no micro-batch."""
    t, longest = cfg.trainer, cfg.engine.max_model_len - 1
    if t.max_tokens_per_microbatch < 0:
        raise ConfigError(f"trainer.max_tokens_per_microbatch must be >= 0 (0: off), got {t.max_tokens_per_microbatch}")
    if t.max_tokens_per_microbatch and not t.packing:
        raise ConfigError(f"trainer.max_tokens_per_microbatch={t.max_tokens_per_microbatch} balances packed "
                          "micro-batches: set trainer.packing=true, or trainer.max_tokens_per_microbatch=0 (then "
                          "optim.micro_batch_size rows each)")
    if 0 < t.max_tokens_per_microbatch < longest:
        raise ConfigError(f"trainer.max_tokens_per_microbatch={t.max_tokens_per_microbatch} is less than the longest "
                          f"row a rollout can give (engine.max_model_len {cfg.engine.max_model_len} − 1 = {longest} "
                          f"positions), which would fit in no micro-batch: set it to at least {longest}")


def check_local_engine_memory(cfg: RunConfig, local_processes: int = 1) -> None:
    """``engine.kv_cache_gib`` against the memory available on this machine, for vLLM's CPU engine (``megarl
    train``/``eval`` before launching ``local_processes`` processes here; not ``megarl plan``, which sizes other
    machines). On GPUs vLLM sizes its KV cache from GPU memory: not checked."""
    e = cfg.engine
    if cuda_available():
        return
    import psutil

    # What each engine process asks vLLM for: colocated, VLLM_CPU_KVCACHE_SPACE (whole GiB, at least 1;
    # vllm_engine.py), one engine worker per rank; replica processes, kv_cache_memory_bytes (replica_process.py),
    # replicas × engine TP of them on rank 0's node (engine.replica_nodes=0). vLLM compares each with the memory
    # available when it starts; they start together.
    if e.placement == "disaggregated":
        asked, engines = e.kv_cache_gib, (e.replicas * e.tensor_parallel_size if not e.replica_nodes else 1)
    else:
        asked, engines = max(1, int(round(e.kv_cache_gib))), max(1, local_processes)
    available = psutil.virtual_memory().available / 2**30
    if asked * engines > available:
        suggest = max(0.25, int(available / 2 / engines * 4) / 4)
        each = f"{engines} engine processes × {asked:g} GiB = {asked * engines:g} GiB" if engines > 1 else \
            f"{asked:g} GiB asked of vLLM's CPU engine"
        raise ConfigError(
            f"engine.kv_cache_gib={e.kv_cache_gib:g} ({each}) is more than the {available:.1f} GiB of memory "
            f"available on this machine; set engine.kv_cache_gib={suggest:g} or less (each engine process holds "
            "its own KV cache, beside the model and the trainer; a colocated engine takes whole GiB, at least 1)")


def check_local_cpus(cfg: RunConfig, local_processes: int = 1) -> str:
    """``trainer.cpu_threads`` / ``engine.cpu_threads`` against this machine's cores, for ``local_processes`` trainer
    ranks here (``megarl train``/``eval`` before launching them); the placement megarl will use, described."""
    from megarl.distributed.placement import node_placement  # deferred: the CLI's config errors stay instant

    for key, value in (("trainer.cpu_threads", cfg.trainer.cpu_threads),
                       ("engine.cpu_threads", cfg.engine.cpu_threads)):
        if value < 0:
            raise ConfigError(f"{key} must be >= 0 (0: megarl chooses), got {value}")
    try:
        return node_placement(cfg, local_processes).describe()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_engine_head_size(hf: dict, where: str) -> None:
    """A model whose attention head size vLLM's CPU engine cannot run is a config error (without it the engine
    fails at its first forward, "Unsupported CPU attention configuration", every evaluation and phase). On CUDA
    vLLM chooses among its GPU attention backends at start; not checked here."""
    if cuda_available():
        return
    from megarl.compat.vllm import cpu_attention_head_sizes  # deferred: it brings torch (config errors stay instant)

    try:
        sizes = cpu_attention_head_sizes()
    except ImportError:  # no vLLM here: nothing to ask (the engine could not start either)
        return
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    head = int(hf.get("head_dim") or hidden // heads)
    if head in sizes:
        return
    how = f"head_dim {head}" if hf.get("head_dim") else f"hidden_size {hidden} / num_attention_heads {heads} = {head}"
    fits = [n for n in range(1, hidden + 1) if hidden % n == 0 and hidden // n in sizes]
    hint = (f"; with hidden_size {hidden}, num_attention_heads in {fits} would give a supported size"
            if fits and not hf.get("head_dim") else "")
    raise ConfigError(f"{where}: attention head size {head} ({how}) cannot run on this machine's vLLM engine: the "
                      f"installed vLLM's CPU attention supports head sizes {list(sizes)}{hint}")


# The rollout keys only some modes read (megarl/rollout/controller.py): set in another mode, they do nothing.
ROLLOUT_KEYS_READ_IN = {
    "oversubscription": ("on_policy", "partial"), "buffer_samples": ("on_policy", "partial"),
    "token_budget": ("on_policy", "partial"), "max_update_groups": ("on_policy", "partial"),
    "stale_action": ("partial",),
    "max_discards": ("on_policy",), "long_rounds": ("on_policy",), "long_round_groups": ("on_policy",),
}


FLOAT16_MAX = 65504.0
"""The largest finite float16; bf16 and fp32 reach ~3.4e38."""


def engine_dtype_notes(cfg: RunConfig) -> list[str]:
    """Said before launch, not refused (a GPU without bf16, e.g. V100 or T4, has float16 engines only): a float16
    engine under a trainer that keeps bf16 or fp32 weights overflows where they do not."""
    if cfg.engine.dtype != "float16":
        return []
    return [f"engine.dtype=float16 under trainer.precision={cfg.trainer.precision}: float16 overflows above "
            f"{FLOAT16_MAX:g} where the trainer's {cfg.trainer.precision} does not, so a synced weight or an "
            "activation beyond it becomes inf in the engine (NaN logprobs, garbage samples) while the trainer sees "
            "finite values; its 10-bit mantissa also rounds differently from bf16's 7, so the behaviour logprobs "
            "drift from the trainer's. Set engine.dtype=auto (the trainer's precision) unless the GPUs lack bf16"]


def unread_keys(cfg: RunConfig) -> list[str]:
    """Keys set away from their defaults that this run does not read (said before launch, not refused: one
    config file is often run in several modes)."""
    r, out = cfg.rollout, []
    for key, modes in ROLLOUT_KEYS_READ_IN.items():
        value = getattr(r, key)
        if r.mode not in modes and value != getattr(RolloutConfig, key):
            value = str(value).lower() if isinstance(value, bool) else value
            out.append(f"rollout.{key}={value} is not read in rollout.mode={r.mode} (only in "
                       f"{' and '.join(modes)} mode)")
    for key in ("eval_prompt_key", "eval_answer_key"):
        if getattr(cfg.data, key) and not cfg.data.eval_path:
            out.append(f"data.{key}={getattr(cfg.data, key)} is not read without data.eval_path")
    if r.staleness_limit != RolloutConfig.staleness_limit and r.mode != "partial" and r.overlap != "async":
        out.append(f"rollout.staleness_limit={r.staleness_limit} is not read in rollout.mode={r.mode} with "
                   f"rollout.overlap={r.overlap} (only in partial mode and with rollout.overlap=async)")
    if r.mode == "on_policy" and not r.long_rounds and r.long_round_groups:
        out.append(f"rollout.long_round_groups={r.long_round_groups} is not read with rollout.long_rounds=false")
    if cfg.trainer.recompute != "full" and cfg.trainer.recompute_layers != TrainerConfig.recompute_layers:
        out.append(f"trainer.recompute_layers={cfg.trainer.recompute_layers} is not read with trainer.recompute="
                   f"{cfg.trainer.recompute} (only with full)")
    return out
