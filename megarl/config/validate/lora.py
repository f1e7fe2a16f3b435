"""``lora.*`` checks before launch: the adapters' values, their targets against the model, and what this stage of
LoRA does not run yet (docs/lora.md), each refused with the key named rather than run wrong.

Built: adapters on megatron-core's local (non-Transformer-Engine) attention and dense MLP linears at any TP (with
or without sequence parallelism) and on every routed expert's at any EP (expert TP 1 or TP's), with dropout and
under any activation recompute, frozen base weights, adapter-only optimizer state (``trainer/lora.py``), the
adapter-only sync into colocated engines and replicas in processes of their own (``weight_sync/adapters.py``;
experts' on CPU engines through ``compat.vllm_moe_lora``). Not built yet, so refused: expert adapters at an expert
TP other than 1 or TP's, FP8, sleep level 2. A dist checkpoint as the base is converted to HF once for the engines
(``convert/lora_base.py``). Adapters on Transformer Engine's linears (``model.transformer_engine=true``; 'auto' keeps
megatron's own under LoRA) are written for GPUs and checked there against the local layers
(``tests/gpu/test_lora_te_gpu.py``); with ``experts`` targeted its experts are megatron's SequentialMLP, not its
grouped GEMMs (``lora_on_experts``).
"""

from __future__ import annotations

from megarl.config.errors import ConfigError
from megarl.config.schema import LoraConfig, RunConfig
from megarl.models.hf_config import is_moe_layer, num_experts

TARGETS = {
    "linear_qkv": "attention QKV (column-parallel)",
    "linear_proj": "attention out (row-parallel)",
    "linear_fc1": "dense MLP in, gate and up (column-parallel)",
    "linear_fc2": "dense MLP out (row-parallel)",
    "experts": "every routed expert's MLP in and out (each expert its own adapters, held where EP puts the expert)",
}
"""The layers that take adapters, by megatron-core's module name (each layer's ``self_attention.*`` or ``mlp.*``;
``experts``: each ``mlp.experts.local_experts.<i>``'s linear_fc1 and linear_fc2; shared experts keep the base)."""
HF_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
              "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",), "experts": ("experts",)}
"""The HF modules each target kind becomes (the modules vLLM wraps for LoRA: its fused-MoE layer is ``experts``;
PEFT's ``target_modules``, the experts' ``target_parameters``: ``trainer/lora_peft.py``)."""

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32 accepts (``vllm.config.lora.MaxLoRARanks``): an engine serves adapters of
the smallest that holds ``lora.rank``."""

NEVER = {"router": "the MoE router never gets an adapter (its routes must stay the engine's)"}


def lora_targets(lora: LoraConfig) -> tuple[str, ...]:
    """``lora.targets`` as a tuple of kinds (checked: known, built, no repeats, at least one)."""
    kinds = tuple(t.strip() for t in lora.targets.split(",") if t.strip())
    valid = f"valid: {', '.join(TARGETS)} (comma-separated)"
    if not kinds:
        raise ConfigError(f"lora.targets is empty; {valid}")
    for kind in kinds:
        why = NEVER.get(kind)
        if why:
            raise ConfigError(f"lora.targets={lora.targets!r}: {kind!r}: {why}; {valid}")
        if kind not in TARGETS:
            raise ConfigError(f"lora.targets={lora.targets!r}: {kind!r} is not a layer kind; {valid}")
    if len(set(kinds)) != len(kinds):
        raise ConfigError(f"lora.targets={lora.targets!r} names a layer kind twice")
    return kinds


def hf_modules(lora: LoraConfig) -> tuple[str, ...]:
    """The HF modules ``lora.targets`` adapts, sorted."""
    return tuple(sorted(m for kind in lora_targets(lora) for m in HF_MODULES[kind]))


def validate_lora(cfg: RunConfig, hf: dict | None = None) -> None:
    """``lora.*`` values (always: a typo fails before it matters) and, with ``lora.rank`` > 0, the targets against
    the model ``hf`` and the combinations this stage does not run."""
    lo = cfg.lora
    if lo.rank < 0:
        raise ConfigError(f"lora.rank must be >= 0 (0: off, full fine-tuning), got {lo.rank}")
    if not lo.alpha > 0:
        raise ConfigError(f"lora.alpha must be > 0 (the adapters' scale is alpha / rank), got {lo.alpha}")
    if not 0.0 <= lo.dropout < 1.0:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {lo.dropout}")
    kinds = lora_targets(lo)
    if lo.rank == 0:
        return
    if hf is not None:
        check_targets_in_model(kinds, hf, cfg.model.path)
    etp = cfg.parallel.etp or cfg.parallel.tp
    if "experts" in kinds and etp not in (1, cfg.parallel.tp):
        raise ConfigError(f"lora.targets={lo.targets!r} at parallel.etp={etp}, parallel.tp={cfg.parallel.tp}: "
                          "expert adapters are built at expert TP 1 or equal to parallel.tp (megatron's gradient "
                          "norm counts a factor replicated over expert TP by the dense TP rank); set parallel.etp=1 "
                          f"or {cfg.parallel.tp}")
    if cfg.model.fp8:
        raise ConfigError(f"lora.rank={lo.rank} with model.fp8={cfg.model.fp8!r}: adapters beside FP8 GEMMs are not "
                          "built; set model.fp8='' (LoRA trains in the trainer's precision)")


def lora_on_experts(lora: LoraConfig | None) -> bool:
    """Whether LoRA is on with ``experts`` among its targets: the experts then run as megatron's SequentialMLP of its
    own linear layers under Transformer Engine too (``trainer.model.te_layer_spec``), not as its grouped GEMMs."""
    return lora is not None and lora.rank > 0 and "experts" in lora_targets(lora)


def check_targets_in_model(kinds: tuple[str, ...], hf: dict, model: str) -> None:
    """Every target kind exists in the model: a dense MLP (``linear_fc1``/``linear_fc2``) needs a layer without
    routed experts (an all-MoE model such as Qwen3-MoE has none; its shared experts are experts); ``experts`` needs
    routed experts."""
    dense = any(not is_moe_layer(hf, i) for i in range(hf["num_hidden_layers"]))
    if "experts" in kinds and not num_experts(hf):
        raise ConfigError(f"lora.targets: 'experts' ({TARGETS['experts']}): model.path={model} is a dense model, "
                          "without routed experts; use linear_qkv,linear_proj,linear_fc1,linear_fc2")
    for kind in kinds:
        if kind in ("linear_fc1", "linear_fc2") and not dense:
            raise ConfigError(f"lora.targets: {kind!r} ({TARGETS[kind]}): model.path={model} has no dense MLP "
                              "layer (every layer routes to experts); use linear_qkv,linear_proj")


def check_lora_run(cfg: RunConfig) -> None:
    """A run with engines (``megarl train``, ``eval``, ``demo``) and ``lora.rank`` > 0: the engines start from the base
    model's HF files and are sent the adapters alone (``weight_sync.adapters``), which needs engines that keep their
    base weights; what does not, refused with the key named."""
    lo, e = cfg.lora, cfg.engine
    if lo.rank <= 0:
        return
    if lo.rank > VLLM_RANKS[-1]:
        raise ConfigError(f"lora.rank={lo.rank}: vLLM serves adapters up to rank {VLLM_RANKS[-1]}")
    if e.sleep_level == 2:
        raise ConfigError(f"lora.rank={lo.rank} with engine.sleep_level=2: level 2 drops the engine's weights for the "
                          "sync to refill, and a LoRA sync sends only the adapters; set engine.sleep_level=1 or 0")
