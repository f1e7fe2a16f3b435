"""The engine interface the rollout side talks to; engines generate, they never schedule."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
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
