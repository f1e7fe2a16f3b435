"""The one engine protocol: what the rollout side asks of an engine. Engines generate; they never schedule.

Two faces, both implemented by every engine megarl drives (the in-process vLLM engine
``engines.vllm_engine``, replicas in processes of their own ``engines.remote``, and the discrete-event
simulator ``rollout.sim.engines``), so the same controller code drives any of them:

- ``Engine``: whole batches (evaluation, the sync audit): ``generate`` → ``Completion`` per sample.
- ``SlotEngine``: the SortedRL controller's step-driven face: ``submit`` a ``SlotRequest`` into a free
  slot, ``step`` → a ``StepReport`` of ``TokenEvent``s, ``abort``.

Nothing here imports vLLM or torch.distributed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class Completion:
    """One generated response: its tokens, per-token behaviour logprobs and why it stopped."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # 'stop' (EOS) | 'length' (hit max_tokens) | 'abort'


@dataclass
class GenerationRequest:
    """Prompt tokens and how to sample from them."""

    prompt_ids: list[int]
    n: int = 1
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False


class Engine(Protocol):
    def generate(self, requests: list[GenerationRequest], seed: int) -> list[list[Completion]]:
        """All completions of each request (``n`` per request), in request order."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights in memory with these HF-named full tensors."""


class TrackedRequests:
    """The request ids a slot engine has in flight (a base of the ``SlotEngine``s): ``abort`` passes on
    only those (``_abort``), ``reset`` forgets them all after the engine under it was restarted."""

    def __init__(self) -> None:
        self._active: set[str] = set()

    def _abort(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def abort(self, request_ids: list[str]) -> None:
        ids = [r for r in request_ids if r in self._active]
        if ids:
            self._abort(ids)
        self._active.difference_update(ids)

    def num_active(self) -> int:
        return len(self._active)

    def reset(self) -> None:
        """Forget every request (the engine under it was restarted)."""
        self._active.clear()


@dataclass
class SlotRequest:
    """Continue (or start) one sample: the tokens so far and how many more it may generate."""

    request_id: str
    prompt_ids: list[int]  # the prompt followed by the sample's tokens generated so far
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    key: tuple[int, int] = (0, 0)  # (prompt index, sample index): lets a simulator look up the sample
    generated: int = 0  # tokens of this sample generated before this request


@dataclass
class TokenEvent:
    """New tokens of one request since the last step, and whether it has finished."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False
    finish_reason: str = ""  # 'stop' | 'length' when finished
    version: int | None = None  # the weight version of the engine that sampled these tokens (None: not known)
    routes: object = None  # routing replay: experts of the positions fed in this step, [rows, MoE layers, k] uint8
    route_start: int = 0  # the position (in prompt + response) of the first of those rows


@dataclass
class StepReport:
    """One engine step: its events, how long it took, and how many sequences were decoding."""

    events: list[TokenEvent]
    elapsed: float
    active: int


class SlotEngine(Protocol):
    slots: int  # concurrent sequences the engine decodes (its batch capacity)

    def submit(self, request: SlotRequest) -> None: ...

    def abort(self, request_ids: list[str]) -> None: ...

    def step(self) -> StepReport: ...

    def num_active(self) -> int: ...
