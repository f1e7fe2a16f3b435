"""Multi-turn episodes on the SortedRL controller: a model turn's end goes to the sample's environment, off the engine.

::

    engine: turn ends with EOS ──► turn_ended: env.step(turn text) submitted to the pool; the sample WAITING, its
                                   engine slot free for others
    pool answers (poll) ────────► answers: a message → its tokens appended (``TurnRenderer``), the sample QUEUED
                                   again, at the head of the run queue; None, a failure, ``env.max_turns`` or no
                                   room left under the sample's max_tokens → the sample FINISHED (its group may
                                   complete)

The trajectory is one token sequence: the model's tokens exactly as sampled (behaviour logprobs, versions) and the
environment's messages as tokens, their positions in ``Sample.env_spans`` (loss mask 0). ``max_tokens`` counts
every token of it. A failed call (raised, hung past ``env.timeout_s``, wrong type, its worker lost) ends the
episode: the sample is scored as it stands (``Sample.env_error`` says why), counted in the phase's metrics and the
pool's ``env/*``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

from megarl.data.chat import TurnRenderer, load_template
from megarl.envs.pool import EnvPool
from megarl.types import Sample, SampleStatus

log = logging.getLogger(__name__)
LOST = "its environment's instance is gone (the run resumed, or a failed phase was put back, mid-episode)"


class Episodes:
    """The environments of a controller's samples; see the module docstring."""

    def __init__(self, pool: EnvPool, render, tokenizer, max_turns: int, max_tokens: int,
                 on_call: Callable[[float, float], None] | None = None) -> None:
        """``on_call(start, end)``: told of each answered call (perf_counter seconds; the trace's spans)."""
        self.pool, self.render, self.tokenizer, self.on_call = pool, render, tokenizer, on_call
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.keys: dict[tuple[int, int], tuple[int, int, int]] = {}  # (group, sample) → its episode's pool key
        self.serial = itertools.count()
        self.waiting: dict[tuple[int, int, int], Sample] = {}  # pool key → the sample awaiting its answer

    def turn_ended(self, index: int, j: int, s: Sample, row: dict | None) -> bool:
        """Sample ``(index, j)`` ended a model turn with EOS: True when it now waits on its environment, False when
        its episode is over (its last turn, or no token left)."""
        key = self.keys.get((index, j))
        if not s.env_messages:  # a first turn: a new episode (a sample run again from its prompt starts afresh)
            if key is not None:
                self.pool.end(key)
            key = self.keys[(index, j)] = (index, j, next(self.serial))
        elif key is None:  # mid-episode, its instance gone: the run resumed, or a failed phase was put back
            s.env_error = f"lost: {LOST}"
            return False
        if s.turns >= self.max_turns or len(s.response_ids) >= self.max_tokens:
            self.pool.end(key)
            return False
        text = self.tokenizer.decode(s.segments()[-1][1], skip_special_tokens=True)
        self.pool.submit(key, dict(row or {}), text)
        self.waiting[key] = s
        s.status = SampleStatus.WAITING
        return True

    def answers(self, timeout: float = 0.0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The environments' answers that arrived (waiting up to ``timeout`` for a first): the samples to run again
        and the samples whose episode ended."""
        again, ended = [], []
        for r in self.pool.poll(timeout):
            if self.on_call is not None:
                now = time.perf_counter()
                self.on_call(now - r.seconds, now)
            s, where = self.waiting.pop(r.key, None), r.key[:2]
            if s is None or self.keys.get(where) != r.key or s.status != SampleStatus.WAITING:
                continue  # (its episode ended meanwhile: the sample started again, or a failed phase reset it)
            if r.error:
                s.env_error = f"{r.kind}: {r.error}"
                log.warning("environment: sample %s: the episode ends after turn %d (%s)", where, s.turns, s.env_error)
            elif r.message is not None:
                ids = self.render(r.message)
                if len(s.response_ids) + len(ids) < self.max_tokens:  # room for the model's next turn
                    s.add_env_turn(r.message, ids)
                    s.status = SampleStatus.QUEUED
                    again.append(where)
                    continue
                s.finish_reason = "length"  # the answer does not fit: cut at the length cap
            self.pool.end(r.key)
            s.status = SampleStatus.FINISHED if s.finish_reason == "stop" else SampleStatus.TRUNCATED
            ended.append(where)
        return again, ended

    def sweep(self, live: dict) -> None:
        """Before a phase: the episodes of groups no longer live (released, discarded, dropped) end; a live sample
        left waiting with no call in flight (a resumed run, a failed phase put back) ends its episode, lost."""
        for where in [w for w in self.keys if w[0] not in live]:
            key = self.keys.pop(where)
            self.waiting.pop(key, None)
            self.pool.end(key)
        asked = {id(s) for s in self.waiting.values()}
        for index, g in live.items():
            for j, s in enumerate(g.samples):
                if s.status == SampleStatus.WAITING and id(s) not in asked:
                    s.env_error = f"lost: {LOST}"
                    s.status = SampleStatus.FINISHED if s.finish_reason == "stop" else SampleStatus.TRUNCATED
                    log.warning("environment: sample %s: the episode ends after turn %d (%s)", (index, j), s.turns,
                                s.env_error)

    def pending(self) -> int:
        return len(self.waiting)

    def reset(self) -> None:
        """Every episode ends (a failed phase: the controller is put back as it was before, so its samples' next
        turn starts a new episode); answers still on their way are ignored."""
        for key in {*self.waiting, *self.keys.values()}:
            self.pool.end(key)
        self.waiting.clear()
        self.keys.clear()


def transcript(s: Sample, tokenizer) -> list[dict]:
    """A sample's episode as chat messages: its model turns (decoded, special tokens left out) and its
    environment's messages, in order."""
    out, env = [], iter(s.env_messages)
    for role, ids in s.segments():
        out.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
                   if role == "assistant" else next(env))
    return out


def build_episodes(cfg, tokenizer, on_call: Callable[[float, float], None] | None = None) -> Episodes | None:
    """The environments ``env.*`` asks for (workers start now; a bad ``env.fn`` raises here), None without one;
    ``on_call``: ``Episodes``'."""
    e = cfg.env
    if not e.fn:
        return None
    render = TurnRenderer(tokenizer, load_template(tokenizer, cfg.data.chat_template))
    pool = EnvPool(e.fn, e.workers, e.timeout_s, tools=e.tools)
    return Episodes(pool, render, tokenizer, e.max_turns, cfg.rollout.max_new_tokens, on_call)
