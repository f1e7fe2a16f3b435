"""Each token's routed experts as a vLLM engine computed them (routing replay: ``algo.routing_replay: rollout``).

vLLM 0.32's own route output (``enable_return_routed_experts``) needs its Model Runner V2, which needs Triton:
refused on CPU. So megarl taps the hook vLLM's own capturer uses: every fused-MoE layer (a ``MoERunner``,
``.layer_id``) has a router that calls ``capture_fn(topk_ids)`` with the top-k expert ids, int32
[scheduled rows, k], on every forward (``BaseRouter.set_capture_fn``; logical ids, before any EPLB mapping).
A forward's rows are the scheduled requests in the persistent batch's order (``input_batch.req_ids``, vLLM's
internal ids), each ``num_scheduled_tokens`` rows long, at positions ``num_computed_tokens`` onwards.

What follows from that (measured on a tiny Qwen3-MoE; the ids equal megatron's and transformers' top-k in fp32):

- A token's route arrives in the step after it was sampled (the step that feeds it in); the last sampled token is
  never fed, so a finished sample has routes for exactly the trainer's input positions (prompt + response − 1).
- Prefix caching skips the cached prompt rows (their routes are never computed): engines that capture routes
  run without it, and a request whose first rows are missing raises rather than leave a hole.
- At engine TP > 1 every rank routes every token (vLLM's TP splits experts' weights, not tokens): each rank
  captures the same ids.

Routes travel as uint8 (< 255 experts: 255 is ``types.no_route``) or int16 arrays [positions, MoE layers, k]: 1 byte per
expert choice, e.g. 94 layers × top-8 = 752 bytes per token for Qwen3-235B-A22B.
"""

from __future__ import annotations

import numpy as np
import torch

from megarl.compat.vllm import before_each_forward


def route_dtype(num_experts: int):
    """The compact numpy dtype of expert ids (one value left for ``no_route``)."""
    return np.uint8 if num_experts < 255 else np.int16


class RouteCapture:
    """Collects, per engine step, the routes of every scheduled request of one in-process vLLM ``LLM``.

    ``collect()`` after each ``llm_engine.step()``, then ``pop(request_id)`` for each request the step had an
    output for: (first position, uint8 array [rows, MoE layers, k]) of every row routed since its last pop (a
    chunked prefill routes rows in steps that give no output)."""

    def __init__(self, llm, num_experts: int) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        self.engine = llm.llm_engine
        self.runner = self.engine.model_executor.driver_worker.worker.model_runner
        runners = sorted((m for m in self.runner.get_model().modules() if isinstance(m, MoERunner)),
                         key=lambda m: m.layer_id)
        if not runners:
            raise ValueError("routing replay: the engine's model has no fused-MoE layer to capture routes from")
        self.layer_ids = [m.layer_id for m in runners]
        self.dtype = route_dtype(num_experts)
        self._ids: dict[int, torch.Tensor] = {}
        self._rows: list[tuple[str | None, int, int]] = []  # (external id, first position, rows) of this forward
        self.pending: dict[str, tuple[int, np.ndarray]] = {}  # external id → routes not yet popped
        for m in runners:
            m.router.set_capture_fn(self._capture_fn(m.layer_id))
        before_each_forward(self.runner, self._forward_starts)

    def _forward_starts(self, scheduler_output) -> None:
        """Note the forward's scheduled requests (their order, first positions and row counts are read at its first
        MoE layer, ``_snapshot``)."""
        self._scheduled = scheduler_output.num_scheduled_tokens
        self._rows = []

    def _capture_fn(self, layer_id: int):
        def capture(topk_ids: torch.Tensor) -> None:
            if not self._rows:
                self._snapshot()
            self._ids[layer_id] = topk_ids.detach().to("cpu", copy=True)
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
        rows, ids = self._rows, self._ids
        self._rows, self._ids = [], {}
        if not rows or not ids:
            return
        missing = [lid for lid in self.layer_ids if lid not in ids]
        if missing:
            raise RuntimeError(f"routing replay: MoE layers {missing} reported no routes in an engine step")
        stacked = np.stack([ids[lid].numpy() for lid in self.layer_ids], axis=1).astype(self.dtype)  # [rows, L, k]
        start = 0
        for rid, first, n in rows:
            if n and rid is not None:
                new = stacked[start:start + n].copy()  # (not a view keeping the whole step's array alive)
                held = self.pending.get(rid)
                if held is not None and held[0] <= first:
                    if held[0] + len(held[1]) < first:
                        raise RuntimeError(f"routing replay: request {rid} routed positions "
                                           f"{held[0]}..{held[0] + len(held[1]) - 1}, then from {first}")
                    new = np.concatenate([held[1][:first - held[0]], new])
                    first = held[0]
                # (a request that starts again from an earlier position, its KV recomputed after an in-flight weight
                # update or a preemption, routes those positions again: the rows held from before are dropped, and a
                # sample keeps the routes of positions it already has: ``Sample.add_routes``)
                self.pending[rid] = (first, new)
            start += n

    def pop(self, request_id: str) -> tuple[int, np.ndarray | None]:
        """(first position, routes) of a request since its last pop; (0, None) when none."""
        return self.pending.pop(request_id, (0, None))

    def forget(self, request_ids) -> None:
        """Aborted requests: their unpopped routes go with them."""
        for rid in request_ids:
            self.pending.pop(rid, None)


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
