"""A slot engine that scripts each model turn, for the multi-turn controller tests (unit and two-process)."""

import time

from megarl.types import StepReport, TokenEvent


class ScriptedEngine:
    """A slot engine whose every model turn is the tokens of ``turn N of sample J`` and EOS, emitted in one step
    (N: the environment messages in its request so far, found by the tool/user headers in the prompt)."""

    def __init__(self, tok, slots: int, step_s: float = 0.0) -> None:
        """``step_s``: wall seconds each step takes (its reported ``elapsed`` stays 0.01)."""
        self.tok, self.slots, self.active, self.log, self.budgets = tok, slots, {}, [], []
        self.step_s = step_s
        self.header = tok.convert_tokens_to_ids("<|im_start|>")

    def submit(self, request) -> None:
        self.active[request.request_id] = request
        self.log.append((request.key, request.generated))
        self.budgets.append(request.max_tokens)

    def abort(self, request_ids) -> None:
        for rid in request_ids:
            self.active.pop(rid, None)

    def num_active(self) -> int:
        return len(self.active)

    def step(self) -> StepReport:
        time.sleep(self.step_s)
        rid, request = next(iter(self.active.items()))
        del self.active[rid]
        turn = (request.prompt_ids.count(self.header) - 2) // 2  # (each environment turn: its and the next headers)
        ids = self.tok(f"turn {turn} of sample {request.key[1]}", add_special_tokens=False)["input_ids"]
        ids = (ids + [self.tok.eos_token_id])[:request.max_tokens]
        reason = "stop" if ids[-1] == self.tok.eos_token_id else "length"
        return StepReport([TokenEvent(rid, ids, [-0.25] * len(ids), True, reason)], 0.01, 1)

    def reset(self) -> None:
        self.active.clear()

    def reseed(self, seed: int) -> None:
        pass
