"""One disaggregated engine replica's process: a vLLM ``LLM`` and the command loop the trainer drives over a pipe.

``serve`` runs in a process of its own (spawned by ``replicas.EngineReplicas`` on trainer rank 0,
or on another node by its first trainer rank: ``nodes.serve_remote``, over TCP) and answers one command at a time
(the typed messages of ``messages.py``): Submit / Abort / Step (the SortedRL controller's slot engine), Generate
(evaluation, the audit), InitTransfer / Update (vLLM's weight-transfer API with our ``megarl_gloo`` backend,
``weight_sync.vllm_backend``; the
reply carries the update's phases and this process's CPU time; ``stage_only``: received and cut into views,
nothing loaded — the bench's transfer-only figure), LoadAdapter (LoRA: the trainer's adapters, registered on every TP
worker and then served; ``load_adapter``), RecvRaw (the bench's transport baseline), Close. An update
is all or nothing across the replica's TP workers: each worker keeps its own failure, and if
any failed every worker restores its backup (``vllm_backend``). With ``sync.rollback: resync``
there is no backup: a failed update leaves the replica unusable (its version ``UNUSABLE``; step
and generate answer ``EngineUnusable``, submits are dropped) until an update succeeds.
"""

from __future__ import annotations

import itertools
import os
import resource
import time
from dataclasses import replace

import torch

from megarl.compat.vllm import lora_patches
from megarl.distributed.placement import CpuShare, vllm_binding
from megarl.distributed.placement import apply as apply_cpus
from megarl.engines.adapters import lora_args, served_request
from megarl.engines.memory import on_gpu
from megarl.engines.remote.messages import (
    Abort,
    Close,
    Generate,
    InitTransfer,
    LoadAdapter,
    Outcome,
    RecvRaw,
    Seed,
    Step,
    StepDone,
    Submit,
    Update,
    Updated,
)
from megarl.engines.routes import capture_args, route_capture
from megarl.engines.vllm_engine import SCHEDULING, generate_batch, kv_cache_args, numerics_args, sampled_logprobs
from megarl.logging.console import configure as configure_console
from megarl.types import SlotRequest, TokenEvent
from megarl.weight_sync.load import UNUSABLE, EngineUnusable, unusable_message
from megarl.weight_sync.vllm_backend import BACKEND, WORKER_EXTENSION

_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def replica_visible_devices(ids: str, inherited: str | None) -> str:
    """A replica's ``CUDA_VISIBLE_DEVICES`` from its ``engine.replica_devices`` ids, which number GPUs as the
    trainer's processes do (cuda:N): through the trainer's own ``CUDA_VISIBLE_DEVICES`` where it has one (a Slurm
    allocation's '4,5,6,7': id 2 is GPU 6; UUIDs and MIG names pass as they are). ``ValueError`` naming the id when
    the trainer does not see that many GPUs."""
    visible = [d.strip() for d in (inherited or "").split(",") if d.strip()]
    if not visible:
        return ids
    out = []
    for d in ids.split(","):
        if int(d) >= len(visible):
            raise ValueError(f"engine.replica_devices names GPU {d}, but this node's trainer process sees "
                             f"{len(visible)} (CUDA_VISIBLE_DEVICES={inherited}): ids count the GPUs it sees, from 0")
        out.append(visible[int(d)])
    return ",".join(out)


def _llm(spec: dict):
    # a replica is no rank of the trainer's job: torchrun's variables would make vLLM's own process
    # group join the trainer's store (TORCHELASTIC_USE_AGENT_STORE) and wait there forever
    for key in [k for k in os.environ if k in _LAUNCHER_ENV or k.startswith(("TORCHELASTIC_", "OMPI_", "PMI_"))]:
        del os.environ[key]
    if spec.get("devices"):  # on GPUs: this replica's own devices (engine.replica_devices)
        os.environ["CUDA_VISIBLE_DEVICES"] = replica_visible_devices(spec["devices"],
                                                                     os.environ.get("CUDA_VISIBLE_DEVICES"))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    place_replica([CpuShare(threads, tuple(cores)) for threads, cores in spec.get("cpus") or []], spec["tp"])
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    from vllm import LLM

    lora_patches()  # (a TP > 1 replica's workers: at vllm_backend's import)
    gpu = on_gpu()
    # on CPU the KV cache is sized by bytes too (VLLM_CPU_KVCACHE_SPACE is whole GiB; a replica's may be less)
    kv = kv_cache_args(spec["kv_cache_gib"], gpu, spec["gpu_memory_utilization"]) if gpu else {
        "kv_cache_memory_bytes": int(spec["kv_cache_gib"] * 2**30)}
    return LLM(model=spec["model"], load_format=spec.get("load_format", "auto"),
               **numerics_args(spec["dtype"], spec["enforce_eager"], gpu), **SCHEDULING,
               max_model_len=spec["max_model_len"], tensor_parallel_size=spec["tp"], seed=spec["seed"],
               logprobs_mode="processed_logprobs", max_num_seqs=spec["slots"], **kv,
               **capture_args(spec.get("route_experts", 0), gpu),
               **lora_args(spec.get("lora_rank", 0), tuple(spec.get("lora_modules", ()))),
               worker_extension_cls=WORKER_EXTENSION, weight_transfer_config={"backend": BACKEND})


def place_replica(workers: list[CpuShare], tp: int) -> None:
    """The replica's cores and threads as its spawner placed them (``distributed.placement``): a TP-1 replica computes
    in this process; a larger one in vLLM's worker processes, bound by ``VLLM_CPU_OMP_THREADS_BIND`` (vLLM's own
    default binds each to a NUMA node, refused with fewer nodes than workers: 'nobind' leaves them to the OS)."""
    if tp == 1 and workers:
        apply_cpus(workers[0])
        return
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", vllm_binding(workers) if workers else "nobind")
    if workers:
        os.environ["OMP_NUM_THREADS"] = str(workers[0].threads)


def _usage() -> tuple[float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


def _used_since(before: tuple[float, int]) -> dict:
    """This process's CPU seconds (every thread: vLLM's load and gloo's receive) and page faults since ``before``."""
    cpu, faults = _usage()
    return {"cpu_s": cpu - before[0], "page_faults": float(faults - before[1])}


def _params(req: SlotRequest):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(n=1, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, logprobs=0,
                          detokenize=False, output_kind=RequestOutputKind.DELTA)


class _WorkersFailed(Exception):
    """A worker's load failed (its own message); every worker has already put its old weights back."""


def serve(conn, spec: dict) -> None:
    """A replica's main loop: one command from the trainer at a time (see the module docstring)."""
    configure_console()
    try:
        llm = _llm(spec)
    except BaseException as exc:  # noqa: BLE001  (reported to the trainer, which names the replica)
        conn.send(Outcome(f"{type(exc).__name__}: {exc}"))
        return
    replica = _Replica(llm, route_capture(llm, spec["model"], on_gpu()) if spec.get("route_experts") else None)
    conn.send(Outcome())
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the trainer is gone: end with it
            return
        if isinstance(msg, Close):
            conn.send(Outcome())
            return
        reply = replica.answer(msg)
        if reply is not None:
            conn.send(reply)


class _Replica:
    """The replica's state between commands: the version it serves, its requests, why it refuses to generate, the
    LoRA adapter its requests ask for (None: the base weights, or no LoRA)."""

    def __init__(self, llm, routes=None) -> None:
        """``routes``: the capture of each token's routes (``engines.routes.route_capture``), None for none."""
        self.llm, self.engine = llm, llm.llm_engine
        self.version, self.unusable = 0, ""
        self.active: dict[str, tuple[SlotRequest, list[int]]] = {}  # running: each request, its tokens since added
        self.routes = routes
        self.lora, self._adapter_ids = None, itertools.count(1)  # vLLM's adapter ids are > 0, a new one per load

    def answer(self, msg):
        """The reply to ``msg`` (None for the commands that have none)."""
        if self.unusable and isinstance(msg, (Submit, Step, Generate)):
            # (a submit has no reply: the trainer's client refuses it first)
            return None if isinstance(msg, Submit) else EngineUnusable(
                f"engine replica refuses to generate: {self.unusable}")
        match msg:
            case Submit(requests):
                for request in requests:
                    self._add(request)
            case Abort(request_ids):
                self._abort([r for r in request_ids if r in self.active])
            case Step():
                return self.step()
            case Seed(seed):
                torch.manual_seed(seed)  # the sampler's stream (per-request generators crash under chunked prefill)
            case Generate(requests, seed):
                torch.manual_seed(seed)
                return generate_batch(self.llm, requests, self.lora)
            case InitTransfer(info):
                try:
                    self.llm.init_weight_transfer_engine({"init_info": info})
                    return Outcome()
                except Exception as exc:  # noqa: BLE001  (reported to the trainer)
                    return Outcome(f"{type(exc).__name__}: {exc}")
            case Update():
                return self.update(msg)
            case LoadAdapter():
                return self.load_adapter(msg)
            case RecvRaw(plan, sources, dtype):
                return self.llm.collective_rpc("megarl_recv_raw", args=(plan, sources, dtype))[0]
            case _:
                return Outcome(f"unknown command {type(msg).__name__}")
        return None

    def _add(self, request: SlotRequest) -> None:
        from vllm.inputs import TokensPrompt  # deferred: vLLM (loaded with the engine, in this process only)

        self.engine.add_request(request.request_id, TokensPrompt(prompt_token_ids=request.prompt_ids),
                                _params(request), lora_request=self.lora)
        self.active[request.request_id] = (request, [])

    def _abort(self, ids: list[str]) -> None:
        if ids:
            self.engine.abort_request(ids)
            if self.routes is not None:
                self.routes.forget(ids)
        for rid in ids:
            del self.active[rid]

    def step(self) -> StepDone:
        start = time.perf_counter()
        outputs = self.engine.step()
        elapsed, events = time.perf_counter() - start, []
        if self.routes is not None:
            self.routes.collect()
        for out in outputs:
            if out.request_id in self.active:
                c = out.outputs[0]
                self.active[out.request_id][1].extend(c.token_ids)
                ev = TokenEvent(out.request_id, list(c.token_ids), sampled_logprobs(c), version=self.version)
                if self.routes is not None:
                    ev.route_start, ev.routes = self.routes.take(out)
                if out.finished:
                    ev.finished, ev.finish_reason = True, c.finish_reason or "length"
                    del self.active[out.request_id]
                events.append(ev)
        return StepDone.packed(events, elapsed, self.version)

    def update(self, u: Update) -> Updated:
        """All or nothing across this replica's TP workers (see the module docstring)."""
        llm = self.llm
        if self.engine.has_unfinished_requests() and not u.in_flight:
            return Updated(self.version, "requests still in flight")
        started = False
        try:
            start, used = time.perf_counter(), _usage()
            if u.stage_only:  # the bench's transfer-only figure: received and staged, nothing loaded
                phases = llm.collective_rpc("megarl_recv_staged", args=(u.plan, u.groups, u.dtype))[0]
                return Updated(self.version, seconds=time.perf_counter() - start,
                               phases={**phases, **_used_since(used)})
            llm.collective_rpc("megarl_set_rollback", args=(u.rollback,))
            started = True
            llm.start_weight_update()
            backup = llm.collective_rpc("megarl_backup_mib")[0]
            llm.update_weights({"update_info": {"buckets": u.plan, "sources": u.groups, "dtype": u.dtype}})
            failures = [f for f in llm.collective_rpc("megarl_update_outcome") if f]
            if failures:  # every worker restores, also those that loaded: never a mix across TP ranks
                llm.collective_rpc("megarl_abandon_update")
                raise _WorkersFailed(failures[0])
            llm.finish_weight_update(weight_version=str(u.version))
            # in flight, running requests hold KV computed under the previous weights: they are preempted and their
            # KV recomputed under the new ones (each next token then comes from the new weights alone, the version
            # it carries); without running requests the prefix cache alone is dropped
            llm.reset_prefix_cache(reset_running_requests=u.in_flight)
            self.version, self.unusable = u.version, ""
            phases = {**llm.collective_rpc("megarl_update_timings")[0], **_used_since(used)}
            return Updated(self.version, backup_mib=backup, seconds=time.perf_counter() - start, phases=phases)
        except Exception as exc:  # noqa: BLE001  (the replica restored its weights; the trainer counts it)
            why = str(exc) if isinstance(exc, _WorkersFailed) else f"{type(exc).__name__}: {exc}"
            if started and u.rollback != "copy":  # nothing to restore: serve nothing until an update succeeds
                self.version, self.unusable = UNUSABLE, unusable_message(why)
            return Updated(self.version, self.unusable or why)

    def load_adapter(self, u: LoadAdapter) -> Updated:
        """LoRA: the trainer's adapters served from now on as ``u.version``, on every TP worker or on none (each
        registers them beside the served ones first: a failure anywhere removes them everywhere, the previous ones
        still served); the prefix cache dropped (its KV came from the previous adapter). In flight, every running
        request goes on under the new adapter (``_rerun_under_adapter``). A failure after the switch (the requests
        half re-added) leaves the replica unusable until a load succeeds, as a failed update without a backup does."""
        if self.engine.has_unfinished_requests() and not u.in_flight:
            return Updated(self.version, "requests still in flight")
        start, used = time.perf_counter(), _usage()
        new_id = next(self._adapter_ids)
        try:
            problems = [p for p in self.llm.collective_rpc("megarl_add_adapter", args=(u.tensors, u.config, new_id))
                        if p]
        except Exception as exc:  # noqa: BLE001  (refused below, as a worker's own failure is)
            problems = [f"{type(exc).__name__}: {exc}"]
        if problems:
            try:
                self.llm.collective_rpc("megarl_remove_adapter", args=(new_id,))
            except Exception:  # noqa: BLE001  (a worker that never registered it)
                pass
            return Updated(self.version, f"LoRA adapter for version {u.version} not loaded ({problems[0]}); the "
                                         "replica still serves the previous one")
        loaded = time.perf_counter() - start
        old, self.lora = self.lora, served_request(u.version, new_id)
        try:
            self._rerun_under_adapter()
            if old is not None:
                self.llm.collective_rpc("megarl_remove_adapter", args=(old.lora_int_id,))
            self.llm.reset_prefix_cache()
        except Exception as exc:  # noqa: BLE001  (the trainer counts it; the keeper restarts the replicas)
            self.version, self.unusable = UNUSABLE, unusable_message(f"{type(exc).__name__}: {exc}")
            return Updated(self.version, self.unusable)
        self.version, self.unusable = u.version, ""
        return Updated(self.version, seconds=time.perf_counter() - start,
                       phases={"load_s": loaded, **_used_since(used)})

    def _rerun_under_adapter(self) -> None:
        """Every running request aborted and added again under the served adapter, its prompt followed by its tokens
        so far as the new prompt (vLLM fixes a request's adapter when it is added): its next tokens, and the KV
        they attend to, come from the new adapter alone, as a full-weight update in flight recomputes the KV."""
        running = list(self.active.values())
        self._abort(list(self.active))
        for request, tokens in running:
            self._add(replace(request, prompt_ids=list(request.prompt_ids) + tokens,
                              max_tokens=request.max_tokens - len(tokens), generated=request.generated + len(tokens)))
