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

A run checkpoint (the controller's state) keeps each episode's instance as the worker pickled it after its last
answer (``state_dict``); a resumed run, or a failed phase put back, goes on from there (``sweep``): the episode's next
call rebuilds the instance, a sample that was waiting is asked again. An instance that cannot be pickled restarts its
sample from the prompt (``env/restarted``).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from megarl.data.chat import TurnRenderer, load_template
from megarl.envs.pool import EnvPool
from megarl.types import Sample, SampleStatus

log = logging.getLogger(__name__)
AGAIN = (SampleStatus.QUEUED, SampleStatus.RESUMED)  # a sample that will run again
LOST = "its environment's instance is gone (the run resumed, or a failed phase was put back, mid-episode)"


class Episodes:
    """The environments of a controller's samples; see the module docstring."""

    def __init__(self, pool: EnvPool, render, tokenizer, max_turns: int, max_tokens: int,
                 on_call: Callable[[float, float], None] | None = None, shared: bool = False) -> None:
        """``on_call(start, end)``: told of each answered call (perf_counter seconds; the trace's spans).
        ``shared``: several trainer ranks run this controller in lockstep (colocated): rank 0's pool runs the
        environments, the other ranks' run none (``EnvPool(runs=False)``), and each ``answers`` hands every rank
        rank 0's answers, and how long it waited for them, at the same point of the phase."""
        self.pool, self.render, self.tokenizer, self.on_call, self.shared = pool, render, tokenizer, on_call, shared
        self.waited = 0.0  # seconds the last ``answers`` waited (rank 0's, under ``shared``)
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.turn_ends = end_of_turn_ids(tokenizer)
        self.keys: dict[tuple[int, int], tuple[int, int, int]] = {}  # (group, sample) → its episode's pool key
        self.serial = itertools.count()
        self.waiting: dict[tuple[int, int, int], Sample] = {}  # pool key → the sample awaiting its answer
        # (group, sample) → its instance pickled after its last answer (what a checkpoint keeps), or why it cannot
        # be; ``restore``: the instances a loaded state hands back, each taken by its episode's next call
        self.saved: dict[tuple[int, int], bytes] = {}
        self.unpicklable: dict[tuple[int, int], str] = {}
        self.restore: dict[tuple[int, int], bytes] = {}
        self.rows: dict[tuple[int, int], dict] = {}  # (group, sample) → its row's columns (an episode asked again)
        self.lock = threading.RLock()  # the controller's: a checkpoint sees the samples and their instances at once

    def turn_ended(self, index: int, j: int, s: Sample, row: dict | None) -> bool:
        """Sample ``(index, j)`` ended a model turn with EOS: True when it now waits on its environment, False when
        its episode is over (its last turn, or no token left)."""
        where, state = (index, j), None
        key = self.keys.get(where)
        if not s.env_messages:  # a first turn: a new episode (a sample run again from its prompt starts afresh)
            if key is not None:
                self.pool.end(key)
            self._forget(where)
            key = None
        elif key is None:  # mid-episode, its instance in a worker no more: rebuilt from the state a checkpoint kept
            state = self._take_restored(where)
            if state is None:  # (``sweep`` restarts such samples before they run: a safeguard)
                s.env_error = f"lost: {LOST}"
                return False
        if s.turns >= self.max_turns or len(s.response_ids) >= self.max_tokens:
            if key is not None:
                self.pool.end(key)
            self._forget(where)
            return False
        self._ask(where, s, row, state)
        return True

    def _ask(self, where: tuple[int, int], s: Sample, row: dict | None, state: bytes | None) -> None:
        """Send the sample's last model turn to its environment (a new key when it has none); the sample waits."""
        key = self.keys.get(where)
        if key is None:
            key = self.keys[where] = (*where, next(self.serial))
        self.rows[where] = dict(row or {})
        text = turn_text(self.tokenizer, s.segments()[-1][1], self.turn_ends)
        self.pool.submit(key, dict(row or {}), text, state)
        self.waiting[key] = s
        s.status = SampleStatus.WAITING

    def _take_restored(self, where: tuple[int, int]) -> bytes | None:
        """The instance a loaded checkpoint kept for ``where``, for the call that rebuilds it; it stays what a
        checkpoint keeps until that call's answer replaces it (taken in flight, a checkpoint would lose it)."""
        state = self.restore.pop(where, None)
        if state is not None:
            self.saved[where] = state
        return state

    def _forget(self, where: tuple[int, int]) -> None:
        for kept in (self.saved, self.unpicklable, self.restore, self.rows):
            kept.pop(where, None)

    def answers(self, timeout: float = 0.0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The environments' answers that arrived (waiting up to ``timeout`` for a first): the samples to run again
        and the samples whose episode ended."""
        start = time.perf_counter()
        results = self.pool.poll(timeout)
        self.waited = time.perf_counter() - start
        if self.shared:  # (one broadcast: the same answers, at the same point, on every rank)
            from megarl.distributed.collectives import share  # deferred: torch.distributed, the controller imports none

            results, self.waited = share((results, self.waited))
        with self.lock:
            return self._apply(results)

    def _apply(self, results) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        again, ended = [], []
        for r in results:
            if self.on_call is not None:
                now = time.perf_counter()
                self.on_call(now - r.seconds, now)
            s, where = self.waiting.pop(r.key, None), r.key[:2]
            if s is None or self.keys.get(where) != r.key or s.status != SampleStatus.WAITING:
                continue  # (its episode ended meanwhile: the sample started again, or a failed phase reset it)
            s.env_s += r.seconds
            if r.kind == "lost" and where in self.saved:  # its worker was replaced for another episode's failed call:
                self.keys.pop(where, None)  # its instance rebuilt on a worker from the one kept after its last answer
                self.pool.resumed += 1  # (env/resumed), and this call asked again
                self._ask(where, s, self.rows.get(where), self.saved[where])
                continue
            if r.error:
                s.env_error = f"{r.kind}: {r.error}"
                log.warning("environment: sample %s: the episode ends after turn %d (%s)", where, s.turns, s.env_error)
            elif r.message is not None:
                ids = self.render(r.message)
                if len(s.response_ids) + len(ids) < self.max_tokens:  # room for the model's next turn
                    s.add_env_turn(r.message, ids)
                    s.status = SampleStatus.QUEUED
                    again.append(where)
                    self._keep(where, r)
                    continue
                s.finish_reason = "length"  # the answer does not fit: cut at the length cap
            self.pool.end(r.key)
            self._forget(where)
            s.status = SampleStatus.FINISHED if s.finish_reason == "stop" else SampleStatus.TRUNCATED
            ended.append(where)
        return again, ended

    def _keep(self, where: tuple[int, int], r) -> None:
        """The instance after its answer, for a checkpoint (or why it cannot be kept, logged once a run)."""
        if r.state is not None:
            self.saved[where] = r.state
            self.unpicklable.pop(where, None)
            return
        self.saved.pop(where, None)
        if not self.unpicklable:
            log.warning("environment: an instance of env.fn=%r cannot be pickled (%s): a run resumed from a "
                        "checkpoint restarts such episodes from their prompt (counted in env/restarted)",
                        self.pool.spec, r.state_error)
        self.unpicklable[where] = r.state_error or "no state came back"

    def sweep(self, live: dict) -> int:
        """Before a phase: the episodes of groups no longer live (released, discarded, dropped) end. A live sample
        mid-episode without an instance in a worker (a resumed run, a failed phase put back) goes on from the
        instance its checkpoint kept (a waiting one asked again at once), or, when none was kept (the instance
        cannot be pickled), starts again from its prompt, counted in ``env/restarted``. The model tokens the
        restarted samples had sampled (wasted). Under the lock: a checkpoint sees each instance kept once."""
        with self.lock:
            return self._sweep(live)

    def _sweep(self, live: dict) -> int:
        for where in [w for w in self.keys if w[0] not in live]:
            key = self.keys.pop(where)
            self.waiting.pop(key, None)
            self.pool.end(key)
        for where in [w for kept in (self.saved, self.unpicklable, self.restore) for w in kept if w[0] not in live]:
            self._forget(where)
        wasted = 0
        for index, g in live.items():
            for j, s in enumerate(g.samples):
                where = (index, j)
                mid = s.status == SampleStatus.WAITING or (s.env_messages and s.status in AGAIN)
                if not mid or where in self.keys:
                    continue
                if s.status == SampleStatus.WAITING and (not s.env_messages or where in self.restore):
                    self.pool.resumed += 1  # (its first turn's call needs no instance: it is built afresh)
                    self._ask(where, s, g.item.extras, self._take_restored(where))
                elif where in self.restore:
                    self.pool.resumed += 1  # (its next turn's end rebuilds the instance: ``turn_ended``)
                else:
                    why = self.unpicklable.get(where, "the checkpoint kept no state of it")
                    log.warning("environment: sample %s: its episode starts again from its prompt after %d turns: "
                                "its instance is gone (the run resumed, or a failed phase was put back) and %s",
                                where, s.turns, why if where not in self.unpicklable else f"cannot be pickled ({why})")
                    self.pool.restarted += 1
                    self._forget(where)
                    wasted += s.model_tokens
                    s.restart()
        return wasted

    def pending(self) -> int:
        return len(self.waiting)

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the episodes: each one's instance after its last answer (pickled), and why
        the others' cannot be kept. The samples themselves are the controller's."""
        with self.lock:
            return {"saved": {**self.restore, **self.saved}, "unpicklable": dict(self.unpicklable)}

    def load_state_dict(self, state: dict) -> None:
        """Every episode in the workers ends (answers still on their way are ignored); the state's instances wait
        for their episodes' next call (``sweep``, ``turn_ended``)."""
        for key in {*self.waiting, *self.keys.values()}:
            self.pool.end(key)
        self.waiting.clear()
        self.keys.clear()
        self.saved, self.restore = {}, dict(state.get("saved", {}))
        self.unpicklable = dict(state.get("unpicklable", {}))

    def close(self) -> None:
        """The environments' worker processes end (a run's end)."""
        self.pool.close()


def end_of_turn_ids(tokenizer) -> set[int]:
    """The tokens a model's turn ends with: the tokenizer's EOS and the ``eos_token_id``s of the model's
    ``generation_config.json`` beside it (where vLLM stops: Llama 3's ``<|eot_id|>``, ``<|eom_id|>``, ...)."""
    ends = {tokenizer.eos_token_id}
    try:
        said = json.loads((Path(tokenizer.name_or_path) / "generation_config.json").read_text()).get("eos_token_id")
        ends |= set(said if isinstance(said, list) else [said])
    except (OSError, ValueError, TypeError, AttributeError):  # no such file (a tokenizer made in memory): its EOS
        pass
    return ends - {None}


def turn_text(tokenizer, ids: list[int], ends: set[int]) -> str:
    """A model turn as its environment reads it: decoded with its special tokens, as vLLM's tool-call parsers
    decode (a ``<tool_call>`` tag is a special token in some tokenizers: skipping them left no call to find), less
    the end-of-turn tokens it stopped on."""
    ids = list(ids)
    while ids and ids[-1] in ends:
        ids.pop()
    return tokenizer.decode(ids, skip_special_tokens=False)


def transcript(s: Sample, tokenizer) -> list[dict]:
    """A sample's episode as chat messages: its model turns (decoded, special tokens left out) and its
    environment's messages, in order."""
    out, env = [], iter(s.env_messages)
    for role, ids in s.segments():
        out.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
                   if role == "assistant" else next(env))
    return out


def build_episodes(cfg, tokenizer, on_call: Callable[[float, float], None] | None = None) -> Episodes | None:
    """The environments ``env.*`` asks for (workers start now, on trainer rank 0 only; a bad ``env.fn`` raises
    here), None without one; ``on_call``: ``Episodes``'. Several trainer ranks: colocated, every rank's controller
    runs the phase in lockstep on rank 0's answers (``shared``); disaggregated, rank 0's alone runs it."""
    from megarl.distributed.collectives import rank_and_world  # deferred: torch.distributed, as above

    e = cfg.env
    if not e.fn:
        return None
    rank, world = rank_and_world()
    render = TurnRenderer(tokenizer, load_template(tokenizer, cfg.data.chat_template),
                          enable_thinking=cfg.data.enable_thinking)
    pool = EnvPool(e.fn, e.workers, e.timeout_s, tools=e.tools, runs=rank == 0)
    return Episodes(pool, render, tokenizer, e.max_turns, cfg.rollout.max_new_tokens, on_call,
                    shared=world > 1 and cfg.engine.placement == "colocated")
