"""Boundary types shared by the rooms: samples, groups, the trainer's batch, and what engines take and give
(requests, completions, token events), like vLLM's own request and output structs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

ROUTE_PARTS = 16
"""A sample's route arrays kept apart at most (``Sample.add_routes``); past it they are merged into one."""


def no_route(dtype) -> int:
    """The expert id of a position the engine did not route (padding, never fed): no expert's (uint8 routes: 255,
    int16: −1)."""
    return 255 if str(dtype).endswith("uint8") else -1


class SampleStatus(enum.Enum):
    """A sample's lifecycle: queued → running → finished | truncated → (resumed →) consumed."""

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"  # ended with EOS
    TRUNCATED = "truncated"  # hit the length cap
    RESUMED = "resumed"  # interrupted, to be continued from its partial tokens
    WAITING = "waiting"  # a model turn ended; its environment's answer is awaited (it holds no engine slot)
    CONSUMED = "consumed"  # handed to the trainer


@dataclass
class Sample:
    """One response to one prompt, with its behaviour-policy record per token."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour logprob of each response token
    versions: list[int] = field(default_factory=list)  # policy version that sampled each token
    status: SampleStatus = SampleStatus.QUEUED
    reward: float = 0.0
    text: str = ""
    finish_reason: str = ""  # 'stop' | 'length' once done
    interruptions: int = 0  # times generation was stopped and later resumed (partial mode)
    routes: list | None = None  # the engine's experts per input position: uint8 arrays [positions, MoE layers, k]
    routed: int = 0  # positions ``routes`` holds (counted as they come: ``add_routes``)
    # multi-turn episodes (``env.fn``): the environment's messages and where their tokens lie in ``response_ids``
    env_messages: list[dict] = field(default_factory=list)
    env_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each message's tokens
    env_error: str = ""  # why the environment ended the episode by failing ('' : it did not)
    env_s: float = 0.0  # seconds its environment's calls took (the controller's expected tool time)

    @property
    def turns(self) -> int:
        """Model turns so far (one more than the environment's messages)."""
        return len(self.env_messages) + 1

    @property
    def env_tokens(self) -> int:
        return sum(b - a for a, b in self.env_spans)

    @property
    def model_tokens(self) -> int:
        """Tokens the model sampled (the trajectory less the environment's): what the loss and length statistics
        count."""
        return len(self.response_ids) - self.env_tokens

    def model_mask(self) -> list[float]:
        """1.0 on each response token the model sampled, 0.0 on the environment's."""
        mask = [1.0] * len(self.response_ids)
        for a, b in self.env_spans:
            mask[a:b] = [0.0] * (b - a)
        return mask

    def model_versions(self) -> list[int]:
        """The policy version of each token the model sampled (the environment's left out): what staleness counts."""
        if not self.env_spans:
            return self.versions
        return [v for v, x in zip(self.versions, self.model_mask()) if x]

    def add_env_turn(self, message: dict, ids: list[int]) -> None:
        """The environment's ``message``, rendered as ``ids``, appended to the trajectory: no logprob of the policy
        (0.0, never trained) and the version of the model token before it (staleness counts the model's)."""
        start = len(self.response_ids)
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else 0] * len(ids)
        self.env_messages.append(message)
        self.env_spans.append((start, start + len(ids)))

    def restart(self) -> None:
        """Back to its prompt: its trajectory (and episode) dropped, queued to be sampled afresh."""
        self.response_ids, self.logprobs, self.versions, self.routes = [], [], [], None
        self.env_messages, self.env_spans, self.env_error, self.env_s = [], [], "", 0.0
        self.status, self.finish_reason = SampleStatus.QUEUED, ""

    def segments(self) -> list[tuple[str, list[int]]]:
        """The trajectory in turns: ('assistant', sampled ids) and ('env', rendered ids), in order."""
        out, at = [], 0
        for a, b in self.env_spans:
            out.append(("assistant", self.response_ids[at:a]))
            out.append(("env", self.response_ids[a:b]))
            at = b
        out.append(("assistant", self.response_ids[at:]))
        return out

    def add_routes(self, first: int, new: np.ndarray) -> None:
        """Routes of positions ``first``.. (``engines.routes``), appended. Positions already known keep theirs: a
        resumed sample's re-prefilled tokens keep the routes of the phase that sampled them. A gap raises (cached
        prefix rows are never routed: prefix caching must be off)."""
        parts = self.routes or []
        # (the count goes with the arrays: None again after a restart or a copy without them; a sample pickled
        # before the count existed has none: counted once)
        have = (self.routed or sum(len(p) for p in parts)) if parts else 0
        if first > have:
            raise RuntimeError(f"routing replay: routes start at position {first} but only {have} are known")
        if len(new) > have - first:
            parts.append(new[have - first:])
            have = first + len(new)
        if len(parts) > ROUTE_PARTS:  # a decode step adds one row: merged, so the arrays stay few
            parts = [np.concatenate(parts)]
        self.routes, self.routed = parts, have

    def route_array(self) -> np.ndarray | None:
        """The routes as one array [positions, MoE layers, k] (None: none captured)."""
        if not self.routes:
            return None
        return self.routes[0] if len(self.routes) == 1 else np.concatenate(self.routes)


@dataclass
class Group:
    """The G samples of one prompt; advantages are computed within it."""

    prompt_index: int
    prompt_text: str
    answer: str
    samples: list[Sample]
    extras: dict | None = None  # its row's other columns (the reward's keyword arguments)


@dataclass
class TrainBatch:
    """Padded tensors for the trainer, one row per sequence, one column per label position.

    Row ``i`` feeds ``input_ids[i]`` (prompt + response without its last token) and
    predicts ``labels[i]`` (the same shifted by one). ``loss_mask`` marks label
    positions that are response tokens; ``weights`` are the loss-aggregation weights
    (zero off the mask); ``old_logprobs`` the behaviour logprobs and ``advantages``
    the per-token advantages at those positions.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    weights: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    # Optional per-token fields some objectives need (None when unused):
    ref_logprobs: torch.Tensor | None = None  # frozen reference policy (KL penalty)
    is_weight: torch.Tensor | None = None  # truncated importance weights (TIS)
    positive: torch.Tensor | None = None  # 1 on tokens of samples with reward >= 1 (VAPO's LM term)
    nll_scale: torch.Tensor | None = None  # per-token factor of that term under ``weights`` (``positive_nll_scale``)
    old_values: torch.Tensor | None = None  # critic values at rollout time
    returns: torch.Tensor | None = None  # value targets
    # routing replay: experts per input position [N, T, MoE layers, k] (uint8), or in the trainer a ``RouteStore``
    # (trainer/route_store.py): this rank's rows, layers and sequence chunk of those, the rest fetched per pass
    routes: object = None
    lengths: torch.Tensor | None = None  # [N] input positions of each row (the rest is padding); None: all T

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def slice(self, start: int, stop: int) -> "TrainBatch":
        return TrainBatch(**{k: v[start:stop] for k, v in self.as_dict().items()})

    def select(self, rows: torch.Tensor) -> "TrainBatch":
        return TrainBatch(**{k: v[rows] for k, v in self.as_dict().items()})

    def pad_rows(self, n: int) -> "TrainBatch":
        """Append ``n`` rows that count for nothing (zero mask and weight)."""
        def pad(k, v):
            if not torch.is_tensor(v):  # a ``RouteStore`` (trainer/route_store.py): rows of padding, no route
                return v.pad_rows(n)
            extra = v[:1].expand(n, *v.shape[1:]).clone()
            if k in ("loss_mask", "weights", "positive", "nll_scale", "is_weight"):
                extra.zero_()
            if k == "routes":
                extra.fill_(no_route(v.dtype))
            if k == "lengths":
                extra.zero_()
            return torch.cat([v, extra])

        return TrainBatch(**{k: pad(k, v) for k, v in self.as_dict().items()})

    def pad_columns(self, n: int) -> "TrainBatch":
        """Append ``n`` label positions that count for nothing (zero mask and weight; positions continue)."""
        def pad(k, v):
            if k == "lengths":
                return v
            if not torch.is_tensor(v):  # a ``RouteStore``: positions of no route
                return v.pad_columns(n)
            extra = torch.zeros(v.shape[0], n, *v.shape[2:], dtype=v.dtype)
            if k == "routes":
                extra.fill_(no_route(v.dtype))
            if k == "position_ids":
                extra = v[:, -1:] + 1 + torch.arange(n).unsqueeze(0)
            return torch.cat([v, extra], dim=1)

        return TrainBatch(**{k: pad(k, v) for k, v in self.as_dict().items()})

    def row_lengths(self) -> list[int]:
        """Input positions of each row (the batch's width where ``lengths`` is unknown)."""
        return self.lengths.tolist() if self.lengths is not None else [self.seq_len] * self.size

    def as_dict(self) -> dict[str, torch.Tensor]:
        """The fields that are set (optional ones left None are omitted)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if getattr(self, k) is not None}


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
