"""Build a megatron-core GPTModel (dense or MoE) from an HF config and load HF weights into it."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarl.compat.megatron import cache_packed_rope, llama3_inv_freq
from megarl.distributed.parallel import ParallelState
from megarl.models.hf_config import (
    check_model_math,
    has_qk_norm,
    has_qkv_bias,
    is_moe_layer,
    norm_topk_prob,
    num_experts,
    rms_norm_eps,
    rope_parameters,
)
from megarl.models.hf_slices import ShardReader
from megarl.models.sharding import layers_per_stage, local_expert_name, tp_split_dim


def transformer_config(cfg: dict, ps: ParallelState, moe_aux_loss_coeff: float = 0.0, moe_z_loss_coeff: float = 0.0,
                       moe_dispatcher: str = "alltoall", dtype: torch.dtype = torch.float32, fp8: str = "",
                       recompute: str = "none", recompute_layers: int = 1, cp_comm_type: str = "p2p"):
    """megatron-core TransformerConfig for an HF config and a parallel layout; ``recompute`` (``trainer.recompute``)
    as ``recompute_settings`` says."""
    from megatron.core.transformer import TransformerConfig

    check_model_math(cfg)
    heads = cfg["num_attention_heads"]
    experts = num_experts(cfg)
    moe = {}
    if experts:
        moe = dict(
            num_moe_experts=experts,
            moe_router_topk=cfg["num_experts_per_tok"],
            moe_ffn_hidden_size=cfg.get("moe_intermediate_size", cfg["intermediate_size"]),
            # softmax over the top-k logits == softmax over all, then top-k renormalised.
            moe_router_pre_softmax=not norm_topk_prob(cfg),
            moe_token_dispatcher_type=moe_dispatcher,
            moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=moe_aux_loss_coeff,
            moe_z_loss_coeff=moe_z_loss_coeff or None,
            moe_grouped_gemm=False,
            # the router's logits, softmax and top-k in fp32 under bf16 (as slime sets it; vLLM ranks in fp32):
            # bf16 scores tie and flip routes, more often the more experts (bench/routing_replay.py)
            moe_router_dtype="fp32" if dtype != torch.float32 else None,
            # Qwen2-MoE: one shared expert beside the routed ones, scaled by sigmoid(w·h).
            moe_shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or None,
            moe_shared_expert_gate=bool(cfg.get("shared_expert_intermediate_size")),
        )
    return TransformerConfig(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=cfg["num_key_value_heads"],
        kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn_hidden_size=cfg["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=rms_norm_eps(cfg),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(cfg),
        qk_layernorm=has_qk_norm(cfg),
        # YaRN scales cos and sin by its attention factor m: q·k grows by m², folded into the softmax scale.
        softmax_scale=yarn_rope(cfg)[1] ** 2 / math.sqrt(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        if rope_parameters(cfg)["rope_type"] == "yarn" else None,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,  # megatron's mixed precision: bf16 weights and activations (fp32 main params
        # and gradients are the optimizer's and DDP's: ``PolicyTrainer``)
        tensor_model_parallel_size=ps.tp,
        pipeline_model_parallel_size=ps.pp,
        virtual_pipeline_model_parallel_size=ps.vpp if ps.vpp > 1 else None,
        # Interleaving sends activations and gradients both ways at once; batched p2p pairs them by
        # posting order, which at PP=2 (next = previous rank) swaps them (measured: grad norm 35
        # instead of 1.0). megatron's own interleaved default: overlapped, unbatched, even/odd ordered.
        overlap_p2p_comm=ps.vpp > 1,
        batch_p2p_comm=ps.vpp == 1,
        expert_model_parallel_size=ps.ep,
        expert_tensor_parallel_size=ps.etp,
        sequence_parallel=ps.sequence_parallel,
        # context parallelism: Transformer Engine's attention exchanges keys and values as ``cp_comm_type`` says
        # (parallel.cp_comm_type); the local spec's ``PackedDotProductAttention`` all-gathers them
        context_parallel_size=ps.cp,
        cp_comm_type=cp_comm_type if ps.cp > 1 else None,
        use_cpu_initialization=True,
        perform_initialization=False,
        # FP8 through Transformer Engine ('hybrid': E4M3 forward, E5M2 gradients) with the named recipe.
        fp8="hybrid" if fp8 else None,
        fp8_recipe=fp8 or "delayed",
        **recompute_settings(recompute, recompute_layers),
        **moe,
    )


def recompute_settings(recompute: str, layers: int = 1) -> dict:
    """``trainer.recompute`` as megatron-core's TransformerConfig keys. 'full': the 'uniform' method, units of
    ``layers`` consecutive layers of a model chunk, each keeping only its input
    (``TransformerBlock._checkpointed_forward`` through ``tensor_parallel.checkpoint``); 'selective': each layer's
    core attention (``recompute_modules`` ['core_attn'], megatron's default; the local spec's
    ``PackedDotProductAttention`` takes packed rows there as well; MoE layers keep theirs: 'moe_act' needs grouped
    GEMMs, and 'moe' would run the router and the token exchange again). Either only while training
    (``self.training``): logprob passes keep nothing for a backward anyway."""
    if recompute == "none":
        return {}
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=layers)
    raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")


class TorchNorm:
    """RMSNorm/LayerNorm from torch that, unlike megatron's ``WrappedTorchNorm``, allows sequence parallelism.

    Under SP a norm sees only its rank's slice of the sequence, so its weight gradient is
    partial: the parameter is marked ``sequence_parallel`` and megatron's
    ``finalize_model_grads`` sums it across the TP group. (q/k norms are summed by name.)
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        module = norm(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in module.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return module


class QKTorchNorm(TorchNorm):
    """The q/k norm: per head, after the sequence is gathered; never marked sequence-parallel."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        module = super().__new__(cls, config, hidden_size, eps)
        for p in module.parameters():
            p.sequence_parallel = False
        return module


def stage_layers(cfg: dict, ps: ParallelState, vp_stage: int = 0) -> list[int]:
    """Global indices of the layers this rank's model chunk ``vp_stage`` holds."""
    layers = cfg["num_hidden_layers"]
    first = ps.coords(vp_stage).first_layer(layers)
    return list(range(first, first + layers_per_stage(layers, ps.pp, ps.vpp)))


def _local_spec(tcfg, moe: bool):
    """megatron's local layer spec (dense or MoE) with ``TorchNorm`` norms and attention that takes packed rows."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megarl.trainer.packed_attention import PackedDotProductAttention  # (megatron's class, subclassed)

    spec = get_gpt_layer_local_spec(
        num_experts=tcfg.num_moe_experts if moe else None,
        moe_grouped_gemm=False,
        qk_layernorm=tcfg.qk_layernorm,
        normalization="RMSNorm",
    )
    sub = spec.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = TorchNorm
    sub.self_attention.submodules.core_attention = PackedDotProductAttention  # + packed rows (trainer.packing)
    if tcfg.qk_layernorm:
        sub.self_attention.submodules.q_layernorm = sub.self_attention.submodules.k_layernorm = QKTorchNorm
    return spec


def layer_spec(tcfg, cfg: dict, layers: list[int], te: bool = False, sequential_experts: bool = False):
    """The block spec of ``layers`` (global indices): each layer dense or MoE as the HF config says;
    megatron's local spec with ``TorchNorm`` norms, or Transformer Engine's (``te``; ``sequential_experts``: see
    ``te_layer_spec``)."""
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    specs = {moe: te_layer_spec(tcfg, moe, sequential_experts) if te else _local_spec(tcfg, moe)
             for moe in (False, True)}
    return TransformerBlockSubmodules(layer_specs=[specs[is_moe_layer(cfg, i)] for i in layers],
                                      layer_norm=LayerNormImpl if te else TorchNorm)


def te_layer_spec(tcfg, moe: bool, sequential_experts: bool = False):
    """Transformer Engine's layer spec (fused norm+linear, FP8-capable GEMMs, grouped expert GEMMs); with
    ``sequential_experts`` (LoRA on the experts: adapters sit on each expert's own linear layers, which grouped GEMMs
    do not have) the routed experts megatron's SequentialMLP of its own linear layers, as the local spec builds them
    (one GEMM per local expert; names, sharding and checkpoints those of the local spec)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=tcfg.num_moe_experts if moe else None,
                                                      moe_grouped_gemm=moe and not sequential_experts,
                                                      qk_layernorm=tcfg.qk_layernorm)
    if moe and sequential_experts:
        local = get_moe_module_spec(use_te=False, num_experts=tcfg.num_moe_experts, moe_grouped_gemm=False)
        spec.submodules.mlp.submodules.experts = local.submodules.experts
    return spec


def build_gpt_model(cfg: dict, ps: ParallelState, vp_stage: int = 0, transformer_engine: bool = False,
                    sequential_experts: bool = False, **kwargs):
    """A GPTModel for this rank's pipeline stage (its chunk ``vp_stage`` under virtual stages):
    the local spec, or Transformer Engine's when asked for and always under FP8 (its experts megatron's own
    SequentialMLP with ``sequential_experts``: LoRA on the experts)."""
    from megatron.core.models.gpt import GPTModel

    cache_packed_rope()  # packed rows: one cos/sin table per micro-batch, not one per layer, row and call
    tcfg = transformer_config(cfg, ps, **kwargs)
    spec = layer_spec(tcfg, cfg, stage_layers(cfg, ps, vp_stage), te=transformer_engine or bool(tcfg.fp8),
                      sequential_experts=sequential_experts)
    coords = ps.coords(vp_stage)
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=cfg["vocab_size"],
        max_sequence_length=cfg.get("max_position_embeddings", 4096),
        pre_process=coords.is_first_stage,
        post_process=coords.is_last_stage,
        vp_stage=vp_stage if ps.vpp > 1 else None,
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=rope_parameters(cfg)["rope_theta"],
        seq_len_interpolation_factor=linear_rope_factor(cfg),
    )
    scale_rope(model.rotary_pos_emb, cfg)
    mark_tensor_parallel_params(model, ps)
    return model


def linear_rope_factor(cfg: dict) -> float | None:
    """``linear`` RoPE scaling (positions divided by ``factor``) is megatron's sequence interpolation."""
    rope = rope_parameters(cfg)
    return float(rope["factor"]) if rope["rope_type"] == "linear" else None


def yarn_rope(cfg: dict) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies and attention factor as transformers computes them, from
    megatron-core's YaRN helpers. (megatron's ``YarnRotaryEmbedding`` itself moves its tables to
    CUDA and GPTModel drops its attention factor outside MLA, so it is not used directly.)"""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_find_correction_range,
        _yarn_get_concentration_factor,
        _yarn_linear_ramp_mask,
    )

    rope = rope_parameters(cfg)
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    base, original = rope["rope_theta"], rope["original_max_position_embeddings"]
    factor = float(rope.get("factor") or cfg["max_position_embeddings"] / original)
    extra = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)  # (also under meta)
    low, high = _yarn_find_correction_range(rope.get("beta_fast") or 32, rope.get("beta_slow") or 1, dim, base,
                                            original, rope.get("truncate", True))
    keep = 1.0 - _yarn_linear_ramp_mask(low, high, dim // 2, device="cpu")
    inv_freq = extra / factor * (1 - keep) + extra * keep
    attention = rope.get("attention_factor") or _yarn_get_concentration_factor(
        factor, rope.get("mscale") or None, rope.get("mscale_all_dim") or None)
    return inv_freq, float(attention)


def scale_rope(rotary: torch.nn.Module, cfg: dict) -> None:
    """Put the HF config's RoPE scaling into megatron's rotary embedding (``llama3``: megatron's own
    frequency scaling with the config's factors; ``yarn``: its frequencies; ``linear`` is set at
    construction). ``check_model_math`` has refused every other type."""
    rope = rope_parameters(cfg)
    if rope["rope_type"] == "llama3":
        rotary.inv_freq = llama3_inv_freq(
            rotary, rotary.inv_freq, factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    elif rope["rope_type"] == "yarn":
        rotary.inv_freq = yarn_rope(cfg)[0].to(rotary.inv_freq.device)


def mark_tensor_parallel_params(model: torch.nn.Module, ps: ParallelState) -> None:
    """Tag TP-sharded parameters the way megatron's own initialisation would.

    megatron-core sets ``tensor_model_parallel`` on a parallel linear's weight only inside
    its init functions, which ``perform_initialization=False`` (we load HF weights) skips.
    Untagged shards count as TP duplicates: the grad norm then sees one rank's half of each
    sharded matrix (measured: 0.718 instead of 1.024 at TP=2) and clipping goes wrong.

    Routed-expert weights are also marked for the expert data-parallel reduction when the expert
    TP size differs from TP: megatron's local experts ask for it only under EP > 1, yet with
    etp < tp the TP ranks hold the same expert and feed it different tokens (their sequence
    shards), so the partial gradients must be summed over the expert data-parallel group, which
    spans those ranks (measured without it: expert weights off by 2·lr after one step at etp=1, tp=2).
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, p in model.named_parameters():
        is_expert = ".experts." in name
        size = ps.etp if is_expert else ps.tp
        dim = tp_split_dim(local_expert_name(name))
        if size > 1 and dim is not None and not getattr(p, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(p, True, dim, 1)
        if is_expert and ps.etp != ps.tp:
            p.allreduce = False


def load_hf_weights(modules: list[torch.nn.Module], model_dir: str | Path, cfg: dict, ps: ParallelState,
                    skip: tuple[str, ...] = ()) -> None:
    """Read this rank's shards of an HF checkpoint into its model chunks (one per virtual stage): each parameter
    (but ``skip``) gets exactly its rows and columns of the HF tensors, read from the safetensors files into the
    parameter (``models/hf_slices.py``), so a rank never holds the model, nor a tensor it does not own beyond one
    block in flight. Every parameter must be covered, in its shape; both are checked before anything is read."""
    reader = ShardReader(model_dir, cfg)
    for vp_stage, model in enumerate(modules):
        coords = ps.coords(vp_stage)
        params = {n: p for n, p in model.named_parameters() if not n.startswith(skip)}
        plans = {n: reader.plan(n, coords) for n in params}
        missing = sorted(n for n, plan in plans.items() if plan is None)
        if missing:
            raise KeyError(f"{model_dir}: no weights for Megatron parameters {missing[:5]}")
        for name, p in params.items():
            if plans[name].shape != tuple(p.shape):
                raise ValueError(f"{model_dir}: {name} has shape {plans[name].shape}, model expects {tuple(p.shape)}")
        for name, p in params.items():
            reader.read(plans[name], out=p)


_SAID: set[str] = set()


def moe_dispatcher_for(requested: str, ps: ParallelState, backend: str = "",
                       log: Callable[[str], None] = print) -> str:
    """The MoE token dispatcher that can run here: megatron's ``alltoall`` at EP > 1 × expert TP > 1 all-gathers
    uneven token counts over the expert TP group (``dispatch_postprocess``), which gloo refuses
    ("ProcessGroupGloo::allgather: invalid tensor size"); there ``allgather`` runs instead (same logprobs and
    step, measured: tests/distributed/test_parallel.py), said once on rank 0. ``flex`` needs DeepEP (GPU only).
    At EP 1 × expert TP 1 neither communicates and both permute tokens alike, but ``alltoall`` copies them twice
    more each way (its sort by local expert, the identity there): ``allgather`` runs, silently (the same bits).
    ``backend`` '': the default group's."""
    if requested == "alltoall" and ps.ep == 1 and ps.etp == 1:
        return "allgather"
    if not backend and dist.is_initialized():
        backend = dist.get_backend()
    if requested != "alltoall" or ps.ep == 1 or ps.etp == 1 or backend != "gloo":
        return requested
    line = (f"parallel.moe_dispatcher: 'alltoall' cannot run on gloo at parallel.ep={ps.ep} × parallel.etp={ps.etp} "
            "(uneven all-gather over the expert TP group); using 'allgather' (same results)")
    if ps.rank == 0 and line not in _SAID:
        _SAID.add(line)
        log(line)
    return "allgather"


class ValueHead(torch.nn.Module):
    """The critic's scalar head in place of GPTModel's output layer: V = w·h + b per position."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            # backward splits, not sums: the head is replicated, every TP rank already holds the whole gradient
            # (the default reduce-scatter, right before a vocab-parallel layer, gave the backbone TP× its gradient)
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None
