"""``engine.placement: disaggregated``: ``engine.replicas`` vLLM engines, each in a process of its own.

::

    trainer (rank 0)                                  replica k (own process, own TP; ``serve``)
      controller ──submit/abort/step (pipe)──────────▶ LLM.llm_engine.add_request / step
      ReplicaClient k  ◀──token events + version──────
      sync: "update" (plan) to every replica ───────▶ LLM.start_weight_update → update_weights → finish
            GlooSender: flag + bucket, broadcast ════▶ (every worker of every replica, one gloo group)
                                               ◀──── ok (+ reset prefix cache, version bump) | failed

Each replica is a ``SlotEngine`` (``ReplicaClient``); the SortedRL controller drives them all from
one shared pull queue. Weights go through vLLM's weight-transfer API with our ``megarl_gloo``
backend (``gloo_transfer``): the trainer broadcasts each bucket once to all replicas. A failed
update leaves a replica serving its old weights (its own backup), and it says so.
"""

from __future__ import annotations

import atexit
import math
import multiprocessing as mp
import os
import time

import torch

from megarl.engines.base import Completion, TrackedRequests
from megarl.engines.weight_update import WeightLoadError
from megarl.launch.bootstrap import free_port
from megarl.rollout.engine_api import SlotRequest, StepReport, TokenEvent


def _llm(spec: dict):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    from vllm import LLM

    return LLM(model=spec["model"], dtype="float32", enforce_eager=True, max_model_len=spec["max_model_len"],
               tensor_parallel_size=spec["tp"], seed=spec["seed"], logprobs_mode="processed_logprobs",
               enable_prefix_caching=True, max_num_seqs=spec["slots"],
               kv_cache_memory_bytes=int(spec["kv_cache_gib"] * 2**30),
               worker_extension_cls="megarl.engines.gloo_transfer.GlooWorkerExtension",
               weight_transfer_config={"backend": "megarl_gloo"})


def _params(req: SlotRequest):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(n=1, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, logprobs=0,
                          detokenize=False, output_kind=RequestOutputKind.DELTA)


def serve(conn, spec: dict) -> None:
    """A replica's main loop: one command from the trainer at a time (see the module docstring)."""
    try:
        llm = _llm(spec)
    except BaseException as exc:  # noqa: BLE001  (reported to the trainer, which names the replica)
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    from vllm.inputs import TokensPrompt

    from megarl.engines.vllm_engine import VLLMEngine, _sampled_logprobs

    engine = llm.llm_engine
    version, active = 0, set()
    conn.send(("ready", None))
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:  # the trainer is gone: end with it
            return
        if cmd == "submit":
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
                    events.append((out.request_id, list(c.token_ids), _sampled_logprobs(c), out.finished,
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
            llm.init_weight_transfer_engine({"init_info": arg})
            conn.send("ok")
        elif cmd == "update":
            plan, dtype, new_version = arg
            if engine.has_unfinished_requests():
                conn.send(("failed", "requests still in flight", version))
                continue
            try:
                llm.start_weight_update()
                backup = llm.collective_rpc("megarl_backup_mib")[0]
                llm.update_weights({"update_info": {"buckets": plan, "dtype": dtype}})
                llm.finish_weight_update(weight_version=str(new_version))
                llm.reset_prefix_cache()
                version = new_version
                conn.send(("ok", backup, version))
            except Exception as exc:  # noqa: BLE001  (the replica restored its weights; the trainer counts it)
                conn.send(("failed", f"{type(exc).__name__}: {exc}", version))
        elif cmd == "recv_raw":
            conn.send(llm.collective_rpc("megarl_recv_raw", args=tuple(arg))[0])
        elif cmd == "close":
            conn.send("closed")
            return


class ReplicaClient(TrackedRequests):
    """The trainer's handle on one replica: a ``SlotEngine`` over a pipe."""

    def __init__(self, index: int, conn, proc, slots: int) -> None:
        self.index, self.conn, self.proc, self.slots = index, conn, proc, slots
        self.weight_version = 0
        super().__init__()

    def submit(self, request: SlotRequest) -> None:
        self.conn.send(("submit", request))
        self._active.add(request.request_id)

    def _abort(self, request_ids: list[str]) -> None:
        self.conn.send(("abort", request_ids))

    def step(self) -> StepReport:
        active = len(self._active)
        self.conn.send(("step", None))
        events, elapsed, version = self.conn.recv()
        report = []
        for rid, toks, lps, finished, reason in events:
            ev = TokenEvent(rid, toks, lps, version=version)
            if finished:
                ev.finished, ev.finish_reason = True, reason
                self._active.discard(rid)
            report.append(ev)
        return StepReport(report, elapsed, active)


class EngineReplicas:
    """K replicas in their own processes, their gloo weight group, and the calls the loop makes on "the engine"."""

    def __init__(self, model_dir: str, replicas: int, tensor_parallel_size: int, max_model_len: int,
                 kv_cache_gib: float, slots: int, seed: int = 0, start_timeout_s: float = 600.0) -> None:
        self.clients: list[ReplicaClient] = []
        self._args = dict(model=str(model_dir), replicas=replicas, tp=tensor_parallel_size,
                          max_model_len=max_model_len, kv_cache_gib=kv_cache_gib, slots=slots, seed=seed,
                          start_timeout_s=start_timeout_s)
        atexit.register(self.close)
        self._start()

    def restart(self) -> None:
        """End every replica and start them again (after an engine error); the caller then syncs the weights."""
        self.close()
        self._start()

    def _start(self) -> None:
        from megarl.engines.gloo_transfer import GlooSender, join_group

        a = self._args
        replicas, tensor_parallel_size, slots, start_timeout_s = a["replicas"], a["tp"], a["slots"], a["start_timeout_s"]
        ctx = mp.get_context("spawn")
        old = self.clients  # on a restart the controller keeps its handles: they get the new processes
        self.clients = []
        for k in range(replicas):
            parent, child = ctx.Pipe()
            spec = dict(model=a["model"], tp=tensor_parallel_size, max_model_len=a["max_model_len"],
                        kv_cache_gib=a["kv_cache_gib"], slots=slots, seed=a["seed"] + k)
            proc = ctx.Process(target=serve, args=(child, spec), name=f"megarl-engine-{k}")
            proc.start()
            if k < len(old):
                c = old[k]
                c.conn, c.proc, c.weight_version = parent, proc, 0
                c.reset()
            else:
                c = ReplicaClient(k, parent, proc, slots)
            self.clients.append(c)
        for c in self.clients:
            if not c.conn.poll(start_timeout_s):
                raise RuntimeError(f"engine replica {c.index} did not start within {start_timeout_s:.0f}s")
            status, detail = c.conn.recv()
            if status != "ready":
                raise RuntimeError(f"engine replica {c.index} failed to start: {detail}")
        port, world = free_port(), 1 + replicas * tensor_parallel_size
        for c in self.clients:
            c.conn.send(("init_transfer", {"host": "127.0.0.1", "port": port, "world_size": world,
                                           "rank_offset": 1 + c.index * tensor_parallel_size}))
        self.sender = GlooSender(join_group("127.0.0.1", port, 0, world))
        for c in self.clients:
            c.conn.recv()

    @property
    def weight_version(self) -> int:
        return min(c.weight_version for c in self.clients)

    def generate(self, requests, seed: int, replica: int = 0) -> list[list[Completion]]:
        """Batch generation (evaluation, the audit) on one replica (0 unless asked)."""
        c = self.clients[replica]
        c.conn.send(("generate", (requests, seed)))
        return c.conn.recv()

    def pause(self) -> None:
        busy = [c.index for c in self.clients if c.num_active()]
        if busy:
            from megarl.weight_sync.protocol import SyncError

            raise SyncError(f"weight sync refused: replicas {busy} still have requests in flight; end the phase first")

    def load(self, plan: list, buckets, version: int, dtype: torch.dtype = torch.float32) -> dict[str, float]:
        """Broadcast ``buckets`` (flat tensors in ``plan`` order) to every replica; all-or-nothing per replica."""
        name = str(dtype).removeprefix("torch.")
        for c in self.clients:
            c.conn.send(("update", (plan, name, version)))
        start, error = time.perf_counter(), None
        sizes = [sum(math.prod(shape) for _, shape in pieces) for pieces in plan]
        try:
            sent = self.sender.send(buckets, sizes, dtype)
        except Exception as exc:  # noqa: BLE001  (the sender told the replicas to restore; report below)
            error, sent = exc, 0
        seconds = time.perf_counter() - start
        replies = [c.conn.recv() for c in self.clients]
        failed = []
        for c, (status, detail, served) in zip(self.clients, replies):
            c.weight_version = served
            if status != "ok":
                failed.append(f"replica {c.index}: {detail}")
        if error is not None or failed:
            why = f"{type(error).__name__}: {error}" if error is not None else "; ".join(failed)
            raise WeightLoadError(f"weight update to version {version} failed ({why}); replicas serve versions "
                                  f"{[c.weight_version for c in self.clients]}")
        backup = max(float(detail) for _, detail, _ in replies)
        return {"sync/backup_mib": backup, "sync/transfer_s": seconds, "sync/sent_bytes": float(sent)}

    def broadcast_raw(self, buckets: list[torch.Tensor]) -> float:
        """The transport alone: the same buckets broadcast to every replica, received and dropped; seconds."""
        for c in self.clients:
            c.conn.send(("recv_raw", ([b.numel() for b in buckets], str(buckets[0].dtype).removeprefix("torch."))))
        start = time.perf_counter()
        self.sender.send(buckets, [b.numel() for b in buckets], buckets[0].dtype)
        for c in self.clients:
            c.conn.recv()
        return time.perf_counter() - start

    def close(self) -> None:
        for c in self.clients:
            if c.proc.is_alive():
                try:
                    c.conn.send(("close", None))
                    if c.conn.poll(10):
                        c.conn.recv()
                except (BrokenPipeError, EOFError, OSError):
                    pass
                c.proc.join(10)
            if c.proc.is_alive():
                c.proc.kill()
                c.proc.join(5)


def plan_buckets(sync) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The HF (name, shape) pieces of each bucket of a ``StreamingSync``, in send order."""
    return [[(n, tuple(s)) for e in entries for n, s in e.hf] for entries in sync.buckets()]


def flat_buckets(sync, plan: list, weights=None):
    """The streamed (name, view) pairs regrouped into the flat bucket tensors they view."""
    it = iter(sync.weights() if weights is None else weights)
    for pieces in plan:
        views = [next(it)[1] for _ in pieces]
        base = views[0]._base
        total = sum(v.numel() for v in views)
        if base is not None and base.dim() == 1 and base.numel() == total:
            yield base
        else:
            yield torch.cat([v.reshape(-1) for v in views])
