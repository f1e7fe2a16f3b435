"""One disaggregated engine replica's process: a vLLM ``LLM`` and the command loop the trainer drives over a pipe.

``serve`` runs in a process of its own (spawned by ``replicas.EngineReplicas`` on trainer rank 0,
or on another node by its first trainer rank: ``nodes.serve_remote``, over TCP) and answers one command at a time: submit / abort / step (the SortedRL controller's slot
engine), generate (evaluation, the audit), init_transfer / update (vLLM's weight-transfer API
with our ``megarl_gloo`` backend; its reply carries the update's phases and this process's CPU
time; ``stage_only``: received and cut into views, nothing loaded — the bench's transfer-only figure),
recv_raw (the bench's transport baseline), close. An update
is all or nothing across the replica's TP workers: each worker keeps its own failure, and if
any failed every worker restores its backup (``gloo_transfer``). With ``sync.rollback: resync``
there is no backup: a failed update leaves the replica unusable (its version ``UNUSABLE``; step
and generate answer ``EngineUnusable``, submits are dropped) until an update succeeds.
"""

from __future__ import annotations

import os
import resource
import time

from megarl.engines.protocol import SlotRequest
from megarl.engines.vllm_engine import VLLMEngine, sampled_logprobs
from megarl.engines.weight_update import UNUSABLE, EngineUnusable, unusable_message

_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def _llm(spec: dict):
    # a replica is no rank of the trainer's job: torchrun's variables would make vLLM's own process
    # group join the trainer's store (TORCHELASTIC_USE_AGENT_STORE) and wait there forever
    for key in [k for k in os.environ if k in _LAUNCHER_ENV or k.startswith(("TORCHELASTIC_", "OMPI_", "PMI_"))]:
        del os.environ[key]
    if spec.get("devices"):  # on GPUs: this replica's own devices (engine.replica_devices)
        os.environ["CUDA_VISIBLE_DEVICES"] = spec["devices"]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM's CPU workers of a TP>1 replica bind to one NUMA node each by default (refused with fewer
    # nodes than workers); replicas that share a host leave the placement to the OS unless told otherwise
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    from vllm import LLM

    return LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=spec["max_model_len"],
               tensor_parallel_size=spec["tp"], seed=spec["seed"], logprobs_mode="processed_logprobs",
               enable_prefix_caching=True, max_num_seqs=spec["slots"],
               kv_cache_memory_bytes=int(spec["kv_cache_gib"] * 2**30),
               worker_extension_cls="megarl.engines.remote.transfer.GlooWorkerExtension",
               weight_transfer_config={"backend": "megarl_gloo"})


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
    try:
        llm = _llm(spec)
    except BaseException as exc:  # noqa: BLE001  (reported to the trainer, which names the replica)
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    version, active, unusable = 0, set(), ""
    conn.send(("ready", None))
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:  # the trainer is gone: end with it
            return
        if unusable and cmd in ("submit", "step", "generate"):
            if cmd != "submit":  # (a submit has no reply: the trainer's client refuses it first)
                conn.send(EngineUnusable(f"engine replica refuses to generate: {unusable}"))
        elif cmd == "submit":
            engine.add_request(arg.request_id, TokensPrompt(prompt_token_ids=arg.prompt_ids), _params(arg))
            active.add(arg.request_id)
        elif cmd == "abort":
            ids = [r for r in arg if r in active]
            if ids:
                engine.abort_request(ids)
            active.difference_update(ids)
        elif cmd == "step":
            start = time.perf_counter()
            outputs = engine.step()
            elapsed, events = time.perf_counter() - start, []
            for out in outputs:
                if out.request_id in active:
                    c = out.outputs[0]
                    events.append((out.request_id, list(c.token_ids), sampled_logprobs(c), out.finished,
                                   c.finish_reason or "length"))
                    if out.finished:
                        active.discard(out.request_id)
            conn.send((events, elapsed, version))
        elif cmd == "generate":
            requests, seed = arg
            shim = VLLMEngine.__new__(VLLMEngine)
            shim.llm = llm
            conn.send(shim.generate(requests, seed))
        elif cmd == "init_transfer":
            try:
                llm.init_weight_transfer_engine({"init_info": arg})
                conn.send("ok")
            except Exception as exc:  # noqa: BLE001  (reported to the trainer)
                conn.send(f"{type(exc).__name__}: {exc}")
        elif cmd == "update":
            plan, sources, dtype, new_version, rollback, stage_only = arg
            if engine.has_unfinished_requests():
                conn.send(("failed", "requests still in flight", version))
                continue
            started = False
            try:
                start, used = time.perf_counter(), _usage()
                if stage_only:  # the bench's transfer-only figure: received and staged, nothing loaded
                    phases = llm.collective_rpc("megarl_recv_staged", args=(plan, sources, dtype))[0]
                    phases.update(_used_since(used))
                    conn.send(("ok", (0.0, time.perf_counter() - start, phases), version))
                    continue
                llm.collective_rpc("megarl_set_rollback", args=(rollback,))
                started = True
                llm.start_weight_update()
                backup = llm.collective_rpc("megarl_backup_mib")[0]
                llm.update_weights({"update_info": {"buckets": plan, "sources": sources, "dtype": dtype}})
                failures = [f for f in llm.collective_rpc("megarl_update_outcome") if f]
                if failures:  # every worker restores, also those that loaded: never a mix across TP ranks
                    llm.collective_rpc("megarl_abandon_update")
                    raise _WorkersFailed(failures[0])
                llm.finish_weight_update(weight_version=str(new_version))
                llm.reset_prefix_cache()
                version, unusable = new_version, ""
                phases = {**llm.collective_rpc("megarl_update_timings")[0], **_used_since(used)}
                conn.send(("ok", (backup, time.perf_counter() - start, phases), version))
            except Exception as exc:  # noqa: BLE001  (the replica restored its weights; the trainer counts it)
                why = str(exc) if isinstance(exc, _WorkersFailed) else f"{type(exc).__name__}: {exc}"
                if started and rollback != "copy":  # nothing to restore: serve nothing until an update succeeds
                    version, unusable = UNUSABLE, unusable_message(why)
                conn.send(("failed", unusable or why, version))
        elif cmd == "recv_raw":
            conn.send(llm.collective_rpc("megarl_recv_raw", args=tuple(arg))[0])
        elif cmd == "close":
            conn.send("closed")
            return
