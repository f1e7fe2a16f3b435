"""Patches of megatron-core 0.16.1 (and of ``torch.cuda`` for it); each names the call it repairs.

- ``activate_cpu`` / ``cpu_suspended``: stock megatron-core on a machine without CUDA (below).
- ``patch_step_copy``: loading the distributed optimizer's 'fully_reshardable' state with torch's Adam
  (``DistributedOptimizer._set_main_param_and_optimizer_states``: KeyError 'step').
- ``checkpoint_writer_process`` / ``drop_dead_checkpoint_writer``: the async checkpoint writer's helper process
  (``filesystem_async._results_queue``), which a save cannot survive losing (BrokenPipeError).
- ``untie_adam_steps``: the distributed optimizer's loaded state shares one Adam ``step`` across parameters.
- ``describe_fresh_state``: a distributed optimizer that never stepped cannot describe its state for a load.
- ``count_expert_grads_once``: the expert optimizer's grad norm skips experts by the dense TP group.
- ``llama3_inv_freq``: megatron's own llama3 RoPE frequency scaling (a private method of its rotary embedding).
- ``cache_packed_rope``: the unfused RoPE of packed rows recomputes its table per call and per row.

Every patch here is written for megatron-core 0.16.1 and refuses another version (``compat.require``).

CPU: megatron-core assumes a GPU in many places. ``activate_cpu()`` applies the smallest set
of patches measured to make TP (+SP), PP, EP (allgather and alltoall), DP and the
distributed optimizer compute on CPU exactly what they compute on GPU. It is a
no-op when CUDA is available, and idempotent. Call it after vLLM is imported
(vLLM evaluates ``torch.cuda.Stream | None`` at import time) and before megatron's
seed call, model and optimizer are built.

Each patch names the megatron-core call that needs it. The cuda→cpu
``TorchFunctionMode`` costs ~5% in step time (measured on the tiny models).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode

from megarl.compat import MEGATRON_CORE, require
from megarl.distributed.context import chunk_positions

VERSION = MEGATRON_CORE

_ACTIVE: "_CudaToCpuMode | None" = None


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # Bare ints mean "cuda:<n>" to torch factories (e.g. device=torch.cuda.current_device()).
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Maps every CUDA device request to the CPU, process-wide.

    Needed by ~40 hard-coded ``device="cuda"`` sites: the causal mask in
    ``transformer.utils``, ``optimizer.distrib_optimizer`` buffers, ``clip_grads``
    (asserts ``torch.cuda.FloatTensor`` and builds its norm on cuda),
    ``pipeline_parallel.p2p_communication`` shape tensors, ``DistributedDataParallel``
    grad buffers.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]  # Tensor.cuda() / pin_memory(): stay where we are.
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # clip_grads: `assert grad.type() == 'torch.cuda.FloatTensor'`.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.is_pinned:
            return False
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _DummyStream:
    """Stands in for ``torch.cuda.Stream`` in the alltoall token dispatcher's DtoH side stream."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return self  # the dispatcher later calls .synchronize() on the returned event

    def __eq__(self, other) -> bool:
        return isinstance(other, _DummyStream)

    def __hash__(self) -> int:
        return 0


def _patch_rng() -> None:
    """``model_parallel_cuda_manual_seed`` and the tracker's add() and fork() use the CUDA RNG: use the CPU one, each
    tracked stream seeded by its own seed (per TP rank, per expert rank, as on GPUs)."""
    from megatron.core.tensor_parallel import random as mp_random

    def get_state(device=None, clone: bool = False, graph_safe: bool = False):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def set_state(new_state, device=-1, graph_safe: bool = False):
        torch.set_rng_state(new_state)

    def add(tracker, name: str, seed: int) -> None:  # a stream seeded by its own seed, the CPU's state untouched
        if seed in tracker.seeds_ or name in tracker.states_:
            raise Exception(f"cuda rng state {name} (seed {seed}) already exists")
        tracker._is_initialized = True
        tracker.seeds_.add(seed)
        tracker.states_[name] = torch.Generator().manual_seed(seed).get_state()

    mp_random._get_cuda_rng_state = get_state
    mp_random._set_cuda_rng_state = set_state
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: None  # the CPU generator is seeded by torch.manual_seed
    # the tracker's add seeds a stream with torch.cuda.manual_seed (above: none on CPU, which left every stream a
    # copy of the CPU state); its fork swaps that stream into the CPU generator, which fork then warns changed
    mp_random.CudaRNGStatesTracker.add = add
    logging.getLogger(mp_random.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage())


def _patch_moe() -> None:
    """MoE without Transformer Engine and with the alltoall dispatcher on CPU."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # moe_utils.router_gemm: `te_general_gemm` is referenced even when TE is absent.
    moe_utils.te_general_gemm = None

    # token_dispatcher.preprocess: split sizes for all_to_all must be host lists; on CPU
    # the tensors are already on the host and are not converted by the stock helper.
    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.cpu().numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = to_host
    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def activate_cpu() -> bool:
    """Apply the CPU patches once; returns True when they are active (no CUDA here)."""
    global _ACTIVE
    if torch.cuda.is_available():
        return False
    if _ACTIVE is not None:
        return True
    require("megatron-core", VERSION)
    # GPTModel / DDP buffer allocation: `device=torch.cuda.current_device()`.
    torch.cuda.current_device = lambda: "cpu"
    # pipeline p2p and dist-checkpoint save call torch.cuda.synchronize().
    torch.cuda.synchronize = lambda device=None: None
    # token_dispatcher: side stream for the DtoH copy of split sizes.
    torch.cuda.Stream = _DummyStream
    torch.cuda.current_stream = lambda device=None: _DummyStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    _patch_rng()
    _patch_moe()
    _ACTIVE = _CudaToCpuMode()
    _ACTIVE.__enter__()
    return True


@contextlib.contextmanager
def cpu_suspended():
    """The cuda→cpu mode off for a block that asks for no CUDA device: a colocated engine's weight load
    (vLLM's layerwise reload makes ~10k torch calls; through the mode they cost ~10–15% of a sync)."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily

    stack = _get_current_function_mode_stack()
    if _ACTIVE is None or not stack or stack[-1] is not _ACTIVE:
        yield  # not active, or another mode on top of it: leave the stack alone
        return
    with _pop_mode_temporarily():
        yield


def patch_step_copy() -> None:
    """megatron-core 0.16.1, torch Adam (no Apex/TE): a 'fully_reshardable' load restores Adam's
    ``step`` from the param groups into each parameter's state, then copies the loaded tensors into
    *every* state entry, 'step' included, which the loaded tensors lack (KeyError: 'step'). Keep the
    restored step for that copy, and the current main param where none was saved."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    require("megatron-core", VERSION)
    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_megarl_keeps_step", False):
        return

    def set_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state.get(main_param, {}).get("step")
            if "step" not in tensors and step is not None:
                tensors = {**tensors, "step": step}
            if "param" not in tensors:  # not saved (see _drop_unsaved_main_params): keep, reload later
                tensors = {**tensors, "param": main_param}
        return original(self, model_param, tensors)

    set_states._megarl_keeps_step = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def checkpoint_writer_process():
    """The ``multiprocessing`` Manager process megatron's async checkpoint writer keeps in this process from its
    first save on (``filesystem_async._get_write_results_queue``), or None."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    require("megatron-core", VERSION)
    return getattr(getattr(filesystem_async._results_queue, "_manager", None), "_process", None)


def drop_dead_checkpoint_writer() -> str:
    """When the checkpoint writer's helper process died (e.g. the OOM killer), drop it so that the next save starts
    a new one instead of failing with ``BrokenPipeError``. What was done ('' nothing)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    process = checkpoint_writer_process()
    if filesystem_async._results_queue is None or process is None or process.is_alive():
        return ""
    filesystem_async._results_queue = None
    return (f"megatron's checkpoint writer helper (multiprocessing Manager, pid {process.pid}) had died "
            f"(exit code {process.exitcode}); a new one is started for this save")


def untie_adam_steps(optimizers) -> None:
    """megatron-core 0.16.1, distributed optimizer without Apex/TE: ``load_state_dict`` gives every parameter's Adam
    state *one shared* ``step`` tensor, which torch's Adam then increments once per parameter in the next step,
    skewing the bias correction (measured: 3.5e-4 weight error after one step at lr 1e-3). Give each parameter its
    own (``optimizers``: the chain's members)."""
    require("megatron-core", VERSION)
    for opt in optimizers:
        for state in getattr(opt, "optimizer", opt).state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def describe_fresh_state(opt) -> bool:
    """megatron-core 0.16.1: a distributed optimizer that never stepped has no 'step' to describe its state for a
    load (``sharded_state_dict``); give it megatron's own dummy state for the description (the caller clears it
    again so that loading allocates its own). Whether it did."""
    require("megatron-core", VERSION)
    if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
        opt._init_optimizer_states_with_dummy_values()
        return True
    return False


def count_expert_grads_once(optimizer, expert_tp_group) -> None:
    """Give megatron's expert optimizer the expert TP group to skip TP duplicates by, in the grad norm (and zero
    count). megatron-core 0.16.1 gives every optimizer the dense TP group: at etp < tp an expert is whole on each
    rank, and a dense TP rank > 0 then leaves its experts out (measured, grad norm vs one process: EP 2 × TP 2 ×
    expert TP 1 0.2% low on every rank; TP 2 × expert TP 1 0.5% low on rank 1 only, so ranks clipped by
    different factors). Counted once each over the expert TP group, the norm is one process's on every rank."""
    require("megatron-core", VERSION)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if opt.param_groups and all(g.get("is_expert_parallel") for g in opt.param_groups):
            opt.tp_group = expert_tp_group


def llama3_inv_freq(rotary, inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> torch.Tensor:
    """Llama-3's RoPE frequency scaling as megatron-core 0.16.1 computes it (``RotaryEmbedding._apply_scaling``, a
    private method: the same numbers as megatron's own llama3 models)."""
    require("megatron-core", VERSION)
    return rotary._apply_scaling(inv_freq, factor=factor, low_freq_factor=low_freq_factor,
                                 high_freq_factor=high_freq_factor,
                                 original_max_position_embeddings=original_max_position_embeddings)


_PACKED_ROPE: list = [None]  # (freqs, cu_seqlens, mscale, dtype, cos, sin) of the last packed micro-batch


def _packed_cos_sin(freqs: torch.Tensor, cu_seqlens: torch.Tensor, mscale: float, dtype: torch.dtype,
                    cp: int = 1, cp_rank: int = 0):
    """cos and sin [t/cp, 1, 1, rotary dim] of each position of a pack this rank holds, as
    ``_apply_rotary_pos_emb_thd`` takes them from ``freqs`` [s, 1, 1, rotary dim]: each row from position 0 (its
    first ``n`` frequencies), or the pack's own positions where ``freqs`` has one per position; under context
    parallelism (``cp`` > 1) this rank's chunks of every row (``distributed.context.chunk_positions``, megatron's
    ``_get_thd_freqs_on_this_cp_rank``). Computed once per pack: every layer's q and k reuse them (megatron's
    rotary embedding returns one tensor per length)."""
    hit = _PACKED_ROPE[0]
    if hit is not None and hit[0] is freqs and hit[1] is cu_seqlens and hit[2:4] == (mscale, dtype):
        return hit[4:]
    in_pack, in_row = chunk_positions(cu_seqlens, cp, cp_rank)
    positions = (in_pack if freqs.size(0) == int(cu_seqlens[-1]) else in_row).to(freqs.device)
    table = freqs[positions]
    cos, sin = (torch.cos(table) * mscale).to(dtype), (torch.sin(table) * mscale).to(dtype)
    _PACKED_ROPE[0] = (freqs, cu_seqlens, mscale, dtype, cos, sin)
    return cos, sin


def cache_packed_rope() -> None:
    """megatron-core 0.16.1's unfused RoPE of packed (``thd``) rows, ``rope_utils._apply_rotary_pos_emb_thd`` (what
    ``SelfAttention`` calls for q and for k of every layer without TE's fused kernel), slices the frequencies row by
    row (a Python loop over the pack's rows), takes their cos and sin, and copies the rotated tensor once more (a
    ``cat`` with an empty pass-through part) on every call. Applied here as megatron applies it,
    ``t·cos + rotate_half(t)·sin``, from one cos/sin table per pack (``_packed_cos_sin``; under context parallelism
    this rank's chunks of the rows); anything else (fused kernels, multi-latent attention, a partial rotary
    dimension, rows not packed) is megatron's own path. Idempotent."""
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half
    from megatron.core.transformer import attention

    require("megatron-core", VERSION)
    original = attention.apply_rotary_pos_emb
    if getattr(original, "_megarl_packed_cache", False):
        return

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        if (cu_seqlens is None or config.apply_rope_fusion or config.multi_latent_attention
                or freqs.shape[-1] != t.shape[-1]):
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        cp = cp_group.size() if cp_group is not None else 1
        cos, sin = _packed_cos_sin(freqs, cu_seqlens, mscale, t.dtype, cp, cp_group.rank() if cp > 1 else 0)
        t = t.unsqueeze(1)  # [t, 1, heads, head dim], as megatron's bshd path takes a pack
        return (t * cos + _rotate_half(t, config.rotary_interleaved) * sin).squeeze(1)

    apply_rotary_pos_emb._megarl_packed_cache = True
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb


def frozen_linear_backward_in_2d() -> None:
    """megatron-core 0.16's ``LinearWithFrozenWeight.backward`` (a frozen base layer under LoRA) multiplies the
    gradient ``[tokens, 1, out]`` by the weight as it comes; when its size-1 dimension has an odd stride (the
    row-parallel layers' does) torch's ``matmul`` cannot fold it into one GEMM and runs a batched one that copies
    the weight once per token (tokens × in × out: GiBs a layer at a few thousand tokens; pytorch/pytorch#186148).
    Flattened to 2-D first, as Megatron-LM#5092 does upstream; the same values. Idempotent."""
    from megatron.core.tensor_parallel import layers

    cls = layers.LinearWithFrozenWeight
    if getattr(cls, "_megarl_2d", False):
        return

    def backward(ctx, grad_output):
        (weight,) = ctx.saved_tensors
        flat = grad_output.reshape(-1, grad_output.shape[-1]).matmul(weight)
        grad_input = flat.view(*grad_output.shape[:-1], weight.shape[-1])
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None

    cls.backward = staticmethod(layers.custom_bwd(backward))
    cls._megarl_2d = True
