"""What the rollout controller needs from an engine: slots, submit, abort, step.

Both the real vLLM engine (``megarl.engines.vllm_engine.VLLMSlotEngine``) and the
discrete-event simulator (``megarl.rollout.simulated.SimulatedEngine``) implement
this, so the same controller code drives either. Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


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
