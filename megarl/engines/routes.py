"""Each token's routed experts as a vLLM engine computed them (routing replay: ``algo.routing_replay: rollout``).

Two ways in, one layout out (``capture_args`` chooses; ``route_capture`` builds):

- **GPU: vLLM's own route output** (``enable_return_routed_experts``, ``ReturnedRoutes``). Its capturer writes every
  router's top-k ids into one preallocated device buffer inside the forward (CUDA graphs replay it; monolithic MoE
  kernels report through their ``routing_sink``), copies a step's rows to the host once, asynchronously, and keeps
  full KV blocks' routes in a store keyed by the blocks' hashes, so a prompt served from the prefix cache still gets
  its rows: vLLM *requires* prefix caching for it. It needs Model Runner V2, which needs Triton (``vllm/config/
  vllm.py``, ``_verify_aux_output_compatibility``), and only the first TP rank's worker holds the rows. An engine of
  TP > 1 inside torchrun (colocated, ``external_launcher``) runs a scheduler on every rank, and vLLM's asserts on
  the others, which get no rows: there it takes none (``compat.vllm.routes_on_first_tp_rank``), so the routes
  arrive on the engine's first rank alone, which is all routing replay reads (``colocated.py``: replicas' first
  ranks send theirs to rank 0, which sends each trainer rank its share). A request's routes come back once, on its
  finished output (``CompletionOutput.routed_experts``, positions 0 .. prompt + response − 2); an aborted request's
  are dropped (the resumed request re-prefills those positions and returns them).
- **CPU: the router hook** (``RouteCapture``). vLLM's CPU build has no Triton backend, so Model Runner V2 and its
  route output are refused there (measured: "Model Runner V2 requires Triton"). megarl binds vLLM's own capturer
  (``RoutedExpertsCapturer``, its buffer in host memory) to every fused-MoE layer's router hook
  (``BaseRouter.set_capture_fn``; logical ids, before any EPLB mapping) and reads the buffer once per engine step.
  A forward's rows are the scheduled requests in the persistent batch's order (``input_batch.req_ids``, vLLM's
  internal ids), each ``num_scheduled_tokens`` rows long, at positions ``num_computed_tokens`` onwards.

Both read vLLM's buffer layout, [tokens, every decoder layer, k] (uint8 up to 256 experts, else uint16; a dense
layer's rows are never written), into megarl's (``vllm_routes``).

What follows from the hook (measured on a tiny Qwen3-MoE; the ids equal megatron's and transformers' top-k in fp32):

- A token's route arrives in the step after it was sampled (the step that feeds it in); the last sampled token is
  never fed, so a finished sample has routes for exactly the trainer's input positions (prompt + response − 1).
- Prefix caching skips the cached prompt rows (their routes are never computed): an engine that captures through
  the hook runs without it, and a request whose first rows are missing raises rather than leave a hole.
- A request that starts again from an earlier position (vLLM preempted it when the KV cache ran out, mid-prefill or
  while decoding, and recomputes it from position 0; or its KV was dropped by an in-flight weight update) routes
  those positions again: the rows held from before are dropped (``restarts`` counts them).
- At engine TP > 1 every rank routes every token (vLLM's TP splits experts' weights, not tokens): each rank
  captures the same ids.

Routes travel as uint8 (< 255 experts: 255 is ``types.no_route``) or int16 arrays [positions, MoE layers, k]: 1 byte per
expert choice, e.g. 94 layers × top-8 = 752 bytes per token for Qwen3-235B-A22B.
"""

from __future__ import annotations

import logging

import numpy as np

from megarl.compat.vllm import before_each_forward, routes_on_first_tp_rank
from megarl.models.hf_config import is_moe_layer, num_experts, read_hf_config

log = logging.getLogger(__name__)


def route_dtype(num_experts: int):
    """The compact numpy dtype of expert ids (one value left for ``no_route``)."""
    return np.uint8 if num_experts < 255 else np.int16


def moe_layer_ids(hf_cfg: dict) -> list[int]:
    """The decoder layers with routed experts, in order: the columns of megarl's routes (vLLM's ``layer_id``s)."""
    return [i for i in range(hf_cfg["num_hidden_layers"]) if is_moe_layer(hf_cfg, i)]


def vllm_routes(rows: np.ndarray, layer_ids: list[int], dtype) -> np.ndarray:
    """vLLM's route rows [tokens, every decoder layer, k] (``RoutedExpertsCapturer``'s layout) as megarl's
    [tokens, MoE layers, k] in ``dtype`` (``route_dtype``), a fresh array."""
    if rows.ndim != 3 or rows.shape[1] <= max(layer_ids):
        raise ValueError(f"routing replay: vLLM returned routes of shape {rows.shape}, expected [tokens, decoder "
                         f"layers > {max(layer_ids)}, k]")
    return rows[:, layer_ids].astype(dtype)


def capture_args(experts: int, gpu: bool) -> dict:
    """``LLM``'s arguments for an engine that captures the routes of a model of ``experts`` experts (0: captures
    none): on a GPU vLLM's route output, which needs prefix caching; on CPU the hook, which cannot see cached
    rows. An engine that captures nothing keeps prefix caching."""
    if experts and gpu:
        return {"enable_prefix_caching": True, "enable_return_routed_experts": True}
    return {"enable_prefix_caching": not experts}


def route_capture(llm, model_dir: str, gpu: bool):
    """The capture of an in-process ``LLM`` of ``model_dir``'s model, started with ``capture_args(experts, gpu)``
    (on a GPU at TP > 1 under torchrun: the engine's first rank's outputs carry the routes, the others' none)."""
    hf_cfg = read_hf_config(model_dir)
    if not gpu:
        return RouteCapture(llm, hf_cfg)
    routes_on_first_tp_rank(llm)
    return ReturnedRoutes(hf_cfg)


class ReturnedRoutes:
    """vLLM's own route output (``enable_return_routed_experts``, GPU): each finished request's routes, from its
    final output. The same face as ``RouteCapture``: ``collect`` after a step, ``take`` per output."""

    restarts = 0  # (vLLM re-sends a preempted request's rows itself)

    def __init__(self, hf_cfg: dict) -> None:
        self.layer_ids, self.dtype = moe_layer_ids(hf_cfg), route_dtype(num_experts(hf_cfg))

    def collect(self) -> None:
        """Nothing to file: the rows arrive on each request's finished output."""

    def take(self, out) -> tuple[int, np.ndarray | None]:
        """(0, routes of every fed position) when ``out`` (a ``RequestOutput``) finished its request; (0, None)
        before, and always on an engine's TP ranks but the first (``routes_on_first_tp_rank``)."""
        rows = out.outputs[0].routed_experts if out.finished else None
        return (0, None) if rows is None else (0, vllm_routes(rows, self.layer_ids, self.dtype))

    def forget(self, request_ids) -> None:
        """Aborted requests: vLLM drops their rows."""

    def clear(self) -> None:
        """Nothing is held here."""


class HeldRoutes:
    """Routes routed but not yet taken, by external request id (a chunked prefill routes rows in steps that give no
    output), and how often a request routed again from an earlier position (``restarts``)."""

    def __init__(self) -> None:
        self.pending: dict[str, tuple[int, np.ndarray]] = {}  # external id → (first position, routes) not yet taken
        self.restarts = 0

    def file(self, rid: str, first: int, new: np.ndarray) -> None:
        """Rows ``new`` of request ``rid`` from position ``first``, after those held (or in their place from
        ``first`` on, when it routes again from an earlier position)."""
        held = self.pending.get(rid)
        if held is not None and first < held[0] + len(held[1]):
            self.restarts += 1  # routed again from ``first``: what was held from there on is dropped
            log.info(f"routing replay: request {rid} routes again from position {first} (preempted, or its KV "
                     f"dropped); {held[0] + len(held[1]) - max(first, held[0])} held rows replaced")
        if held is not None and held[0] <= first:
            if held[0] + len(held[1]) < first:
                raise RuntimeError(f"routing replay: request {rid} routed positions "
                                   f"{held[0]}..{held[0] + len(held[1]) - 1}, then from {first}")
            new = np.concatenate([held[1][:first - held[0]], new])
            first = held[0]
        # (a sample keeps the routes of positions it already has: ``Sample.add_routes``)
        self.pending[rid] = (first, new)

    def take(self, out) -> tuple[int, np.ndarray | None]:
        """(first position, routes) of ``out``'s request (a ``RequestOutput``) since its last take; (0, None) when
        none."""
        return self.pending.pop(out.request_id, (0, None))

    def forget(self, request_ids) -> None:
        """Aborted requests: their untaken routes go with them."""
        for rid in request_ids:
            self.pending.pop(rid, None)

    def clear(self) -> None:
        """Every held route dropped (the controller's reset)."""
        self.pending.clear()


class RouteCapture(HeldRoutes):
    """Collects, per engine step, the routes of every scheduled request of one in-process vLLM ``LLM`` (CPU).

    ``collect()`` after each ``llm_engine.step()``, then ``take(output)`` for each request the step had an output
    for: (first position, array [rows, MoE layers, k]) of every row routed since its last take (a chunked prefill
    routes rows in steps that give no output)."""

    def __init__(self, llm, hf_cfg: dict) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer

        self.engine = llm.llm_engine
        self.runner = self.engine.model_executor.driver_worker.worker.model_runner
        runners = [m for m in self.runner.get_model().modules() if isinstance(m, MoERunner)]
        if not runners:
            raise ValueError("routing replay: the engine's model has no fused-MoE layer to capture routes from")
        self.layer_ids, self.dtype = moe_layer_ids(hf_cfg), route_dtype(num_experts(hf_cfg))
        if sorted(m.layer_id for m in runners) != self.layer_ids:
            raise ValueError(f"routing replay: the engine's MoE layers are {sorted(m.layer_id for m in runners)}, the "
                             f"model's config.json says {self.layer_ids}")
        config = self.runner.vllm_config
        self.capturer = RoutedExpertsCapturer(config.scheduler_config.max_num_batched_tokens, config)
        self._rows: list[tuple[str | None, int, int]] = []  # (external id, first position, rows) of this forward
        self._seen: set[int] = set()  # the MoE layers that routed in this forward
        super().__init__()
        for m in runners:
            m.router.set_capture_fn(self._capture_fn(m.layer_id))
        before_each_forward(self.runner, self._forward_starts)

    def _forward_starts(self, scheduler_output) -> None:
        """Note the forward's scheduled requests (their order, first positions and row counts are read at its first
        MoE layer, ``_snapshot``)."""
        self._scheduled = scheduler_output.num_scheduled_tokens
        self._rows, self._seen = [], set()

    def _capture_fn(self, layer_id: int):
        def capture(topk_ids) -> None:
            if not self._rows:
                self._snapshot()
            self.capturer.capture(layer_id, topk_ids)  # into vLLM's buffer: no copy of its own per layer
            self._seen.add(layer_id)
        return capture

    def _snapshot(self) -> None:
        """The forward's requests by external id (read now: a request finishing in this step has left the output
        processor by the time the step returns)."""
        batch, states = self.runner.input_batch, self.engine.output_processor.request_states
        rows = []
        for i, rid in enumerate(batch.req_ids[: batch.num_reqs]):
            state = states.get(rid)
            rows.append((state.external_req_id if state is not None else None, int(batch.num_computed_tokens_cpu[i]),
                         int(self._scheduled.get(rid, 0))))
        self._rows = rows

    def collect(self) -> None:
        """File the last step's routes under their requests' external ids."""
        rows, self._rows = self._rows, []
        total = sum(n for _, _, n in rows)
        if not total:
            return
        if missing := [lid for lid in self.layer_ids if lid not in self._seen]:
            raise RuntimeError(f"routing replay: MoE layers {missing} reported no routes in an engine step")
        stacked = vllm_routes(self.capturer.snapshot_routing_data(total).numpy(), self.layer_ids, self.dtype)
        start = 0
        for rid, first, n in rows:
            if n and rid is not None:
                self.file(rid, first, stacked[start:start + n].copy())  # (not a view of the whole step's array)
            start += n


def step_samples(slots, running: dict, steps: int | None = None) -> int:
    """Step a slot engine until the ``running`` requests ({request id: ``Sample``}) finish (or ``steps`` steps),
    recording each event's tokens, behaviour logprobs and routes on its sample: the controller's bookkeeping
    reduced to what route checks and benchmarks read. Finished requests leave ``running``; returns the steps."""
    n = 0
    while running and (steps is None or n < steps):
        for ev in slots.step().events:
            s = running[ev.request_id]
            s.response_ids += ev.token_ids
            s.logprobs += ev.logprobs
            if ev.routes is not None:
                s.add_routes(ev.route_start, ev.routes)
            if ev.finished:
                del running[ev.request_id]
        n += 1
    return n
