"""One generation phase of the SortedRL controller, as an object whose steps read in the order they run.

    Phase(controller, version).run():
        release_held()            partial: stale samples expire; groups held past the last bound come first
                                  (multi-turn: episodes of groups gone end)
        admit()                   a long round's groups, or admission up to the live target; queue; engine shares
        admit_for_free_slots()    (on_policy / partial) more groups while a free slot has nothing to run
                                  (partial under overlap: no more live groups than ``room()`` allows)
        dispatch()                fill every engine's free slots
        while (running or waiting) and not done():
            step()                one step of the engine furthest behind in time (none while every sample
                                  waits on its environment): record() its tokens; a turn ended with EOS goes to
                                  the sample's environment (``turns.py``), its slot freed
            env_answers()         multi-turn: answered samples re-queued first; ended episodes may complete a group
            complete()            complete groups harvested (released or held)
            after_step():           drain() when pinned groups hold the rest of the batch
                                    admit_for_free_slots() | replace_filtered() (sync + dynamic sampling)
                                    dispatch()
        end()                     abort what still runs (kept or discarded by mode), the phase's metrics

The controller (``controller.py``, with its state half in ``admission.py``) owns what outlives a phase (live groups,
queues, the partial buffer) and offers the steps above as its public methods; a phase owns what it is running now
(requests, engine clocks, the batch it releases) and calls them in order.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING

from megarl.rollout.phase_metrics import PhaseMetrics
from megarl.types import Group, SampleStatus, SlotRequest, StepReport

if TYPE_CHECKING:
    from megarl.rollout.controller import RolloutController

DONE = (SampleStatus.FINISHED, SampleStatus.TRUNCATED)
STALL_STEPS = 1000
"""Steps in a row of one engine that has requests outstanding yet produces no token: the engine is stuck
(``EngineStalled``). A working engine emits a token within a few steps (a long prompt's chunked prefill takes
max_model_len / the scheduler's token budget of them); a stuck one returns each step at once, scheduling
nothing, so a phase would spin forever, past the hang watchdog (every step returns) and past a preemption
signal (read between RL steps)."""


class EngineStalled(RuntimeError):
    """An engine made no progress for ``STALL_STEPS`` steps in a row: an engine error (the keeper contains it)."""


class PhaseStopped(Exception):
    """A preemption signal (its name: ``args[0]``) came while the trainer's own thread ran the phase
    (``RolloutController.interrupt``): it stopped between two engine steps; the caller puts the controller back
    (``rollout.phases``), saves and stops."""


class Phase:
    """One generation phase of a ``RolloutController``; ``run`` calls its steps in the order they happen."""

    def __init__(self, c: RolloutController, version: int) -> None:
        self.c, self.cfg, self.version = c, c.cfg, version
        self.m = PhaseMetrics(multi_turn=c.episodes is not None)
        self.released: list[Group] = []
        self.running: dict[str, tuple[int, int]] = {}  # request id → (group index, sample index)
        self.engine_of: dict[str, int] = {}  # request id → engine
        self.times = [c.clock] * len(c.engines)  # each engine's clock
        self.now = c.clock  # the engine time of the last step made
        self.stalled = [0] * len(c.engines)  # each engine's steps in a row without a token
        self.tokens, self.serial, self.drain_at = 0, 0, None
        self.budget = self.cfg.buffer_samples or float("inf")
        self.members: set[int] | None = None  # a long round's groups (None: not a long round)
        self.pinned: set[int] = set()
        self.completed: list[int] = []  # groups whose samples the last engine step finished, to release

    def run(self) -> tuple[list[Group], PhaseMetrics]:
        engines = self.c.engine_turn  # one engine step at a time (an in-flight weight sync comes between two)
        with engines():
            self.reseed()
        self.release_held()  # (held groups scored outside the engines' gate, as every completed group is)
        with engines():
            self.admit()
            if self.fill:
                self.admit_for_free_slots()
            self.dispatch()
        while (self.running or self.c.waiting()) and not self.done():
            if signal := self.c.interrupt():  # (a preemption: the save must not wait for the phase to end)
                raise PhaseStopped(signal)
            with engines():
                k = self.step() if self.running else None
            if self.c.episodes is not None:  # environments' answers (waited for when no engine has work)
                self.env_answers(block=k is None)
            for index in self.completed:  # scored outside the engines' gate: a sync or a checkpoint need not wait
                self.complete(index)
            self.completed = []
            with engines():
                self.after_step(k)
        with engines():
            return self.end()

    # ---- before the first step ----------------------------------------------------------
    def reseed(self) -> None:
        """The engines' sampling streams from the controller's ``phase_seed`` (inside the phase: an engine that
        fails to take it fails the phase, which the keeper contains on every rank alike)."""
        if self.c.phase_seed is not None:
            for k, engine in enumerate(self.c.engines):
                engine.reseed(self.c.phase_seed + k)

    def release_held(self) -> None:
        """Partial mode: stale samples expire. Groups held whole (past the last bound, or released by a phase a
        checkpoint caught in flight) come first in this batch."""
        c = self.c
        if self.cfg.mode == "partial":
            c.expire_stale(self.version, self.m)
        if c.episodes is not None:  # (episodes of groups gone end; one whose instance is gone goes on or restarts)
            self.m.tokens_wasted += c.episodes.sweep(c.live)
        for index in [i for i, g in c.live.items() if all(s.status in DONE for s in g.samples)]:
            if len(self.released) < self.cfg.batch_bound:
                c.release(index, self.version, self.released, self.m)

    def admit(self) -> None:
        """A long round's groups, or admission up to the phase's live target; then the queue and each engine's share."""
        c, cfg = self.c, self.cfg
        self.members = c.long_round(self.version)
        if self.members is not None:
            self.m.long_rounds = 1
        else:
            c.admit(self.version, cfg.update_groups if cfg.mode == "sync" else min(cfg.rollout_groups, self.room()))
        self.pinned = c.pin()
        self.queue = c.run_order(self.members, self.pinned)
        self.own = c.balance(self.queue, self.members if self.members is not None else self.pinned, c.engines)
        self.fill = cfg.mode != "sync" and self.members is None

    # ---- what each step does ------------------------------------------------------------
    def dispatch(self) -> None:
        """Fill every engine's free slots: its own share first (long rounds, pinned), then the shared queue."""
        c, cfg = self.c, self.cfg
        for k, engine in enumerate(c.engines):
            mine = self.own[k]
            while (mine or self.queue) and engine.num_active() < engine.slots:
                index, j = mine.popleft() if mine else self.queue.popleft()
                s = c.live[index].samples[j]
                if s.response_ids and s.status != SampleStatus.QUEUED:  # (queued with tokens: its next turn)
                    s.interruptions += 1
                s.status = SampleStatus.RUNNING
                self.serial += 1
                rid = f"{index}:{j}:{self.serial}"
                engine.submit(SlotRequest(rid, s.prompt_ids + s.response_ids, cfg.max_tokens - len(s.response_ids),
                                          cfg.temperature, cfg.top_p, key=(index, j), generated=len(s.response_ids)))
                self.running[rid], self.engine_of[rid] = (index, j), k

    def admit_for_free_slots(self) -> None:
        """Keep ≥ rollout_groups live, and admit while a free slot has no runnable sample (within budget). A sample
        waiting on its environment counts as runnable: it needs a slot again once answered (otherwise every step of
        a slow tool's wait would admit another group, and the live set grow to the whole source)."""
        c, cfg = self.c, self.cfg
        free, room = sum(e.slots - e.num_active() for e in c.engines), self.room()
        while len(c.live) < room and (len(c.live) < cfg.rollout_groups or (
                len(self.queue) + sum(map(len, self.own)) + c.waiting() < free
                and len(self.running) + len(self.queue) + c.waiting() + cfg.group_size <= self.budget)):
            index = c.admit_one(self.version)
            if index is None:
                return
            entries = c.entries([index])
            if c.live[index].discards:  # a re-queued prompt goes to the head of the queue
                self.queue.extendleft(reversed(entries))
            else:
                self.queue.extend(entries)

    def room(self) -> float:
        """The most groups live now. Partial under overlap, with the engines ``lag`` versions behind this batch's:
        a sample started now may be trained in this batch or, carried over, in the next k − lag ones at most (then
        it is stale), so admission keeps no more groups live than those k − lag + 1 batches take, (k − lag + 1)·U,
        less the groups this phase released (AReaL's rule, per sample: at the bound, lag = k, only what this batch
        still needs; it loosens when a weight load lands mid-phase). No bound at lag 0, as without overlap."""
        c, cfg = self.c, self.cfg
        lag = self.version - c.engine_version(self.now) if c.engine_version is not None else 0
        if cfg.mode != "partial" or lag <= 0:
            return float("inf")
        return (max(cfg.staleness_limit - lag, 0) + 1) * cfg.update_groups - len(self.released)

    def step(self) -> int:
        """One step of the engine furthest behind in time (which one it was); its tokens go to their samples, and
        the groups it completed are noted (``completed``)."""
        c, m = self.c, self.m
        k = min((k for k in range(len(c.engines)) if c.engines[k].num_active()), key=lambda k: self.times[k])
        start = time.perf_counter()
        report: StepReport = c.engines[k].step()
        if c.on_engine_step is not None:  # (the timeline: one track per engine)
            c.on_engine_step(k, start, time.perf_counter())
        self.stalled[k] = 0 if any(ev.token_ids or ev.finished for ev in report.events) else self.stalled[k] + 1
        if self.stalled[k] >= STALL_STEPS:
            raise EngineStalled(f"engine {k} made no progress: {STALL_STEPS} steps in a row produced no token "
                                f"while {c.engines[k].num_active()} of its requests were outstanding")
        self.times[k] += report.elapsed
        self.now = self.times[k]
        m.slot_time_busy += report.active * report.elapsed
        for ev in report.events:
            self.record(ev, report.elapsed)
        return k

    def after_step(self, k: int | None) -> None:
        """The admissions and the dispatch engine ``k``'s step allows."""
        c, cfg, m = self.c, self.cfg, self.m
        if self.fill and self.pinned and (len(self.released) + self.pending_pinned() >= cfg.update_groups
                                          or self.at_cap()):
            self.drain()  # (at the oversampling cap: no more admissions while the pinned groups finish)
            self.drain_at = self.now
        if self.fill:
            self.admit_for_free_slots()
        elif cfg.mode == "sync" and m.groups_filtered and not self.at_cap():
            self.replace_filtered()
        self.dispatch()
        for kk in range(len(c.engines)):  # an idle engine waits until now
            if not c.engines[kk].num_active():
                self.times[kk] = max(self.times[kk], self.now)

    def record(self, ev, elapsed: float) -> None:
        """An engine's new tokens of one sample; a finished sample may complete its group."""
        c, m = self.c, self.m
        key = self.running[ev.request_id]
        index, j = key
        s = c.live[index].samples[j]
        n = len(ev.token_ids)
        s.response_ids += ev.token_ids
        s.logprobs += ev.logprobs
        if ev.routes is not None:  # routing replay: earlier phases' routes of these positions stay
            s.add_routes(ev.route_start, ev.routes)
        version = self.version if ev.version is None else ev.version  # the sampling engine's version
        s.versions += [version] * n
        m.sampled_versions[version] += n
        c.slot_time[key] = c.slot_time.get(key, 0.0) + elapsed  # it held a slot for the whole step
        self.tokens += n
        m.tokens_generated += n
        if ev.finished:
            del self.running[ev.request_id], self.engine_of[ev.request_id]
            s.finish_reason = ev.finish_reason
            if ev.finish_reason == "stop" and c.episodes is not None and \
                    c.episodes.turn_ended(index, j, s, c.live[index].item.extras):
                m.tool_calls += 1
                return  # it waits on its environment, holding no slot
            self.sample_done(index, s)

    def sample_done(self, index: int, s) -> None:
        """A sample's episode is over (its last turn, or a single-turn sample): its group may complete."""
        c, m = self.c, self.m
        s.status = SampleStatus.FINISHED if s.finish_reason == "stop" else SampleStatus.TRUNCATED
        m.samples_finished += 1
        m.len_finished_sum += s.model_tokens
        if index not in self.completed and all(x.status in DONE for x in c.live[index].samples):
            self.completed.append(index)  # (once: its last two samples may end in one step, engine and env)

    def env_answers(self, block: bool) -> None:
        """Environments' answers: samples whose episode goes on re-enter the run queue first; the others are done.
        ``block``: no engine has work, so wait for an answer (the engines idle meanwhile: their clocks move on)."""
        episodes = self.c.episodes
        again, ended = episodes.answers(timeout=episodes.pool.timeout_s + 1.0 if block else 0.0)
        if block:  # (the wait as rank 0 measured it: lockstep ranks move their clocks alike)
            self.times = [t + episodes.waited for t in self.times]
            self.now += episodes.waited
        with self.c.lock:  # (outside the engines' gate)
            for index, j in reversed(again):
                if index not in self.c.live:
                    continue  # (its group left meanwhile: the next phase's sweep ends its episode)
                if self.drain_at is not None and index not in self.pinned:
                    self.c.live[index].samples[j].status = SampleStatus.RESUMED  # drained: on in a later phase
                else:
                    self.queue.appendleft((index, j))
            for index, j in ended:
                if index in self.c.live:
                    self.sample_done(index, self.c.live[index].samples[j])

    def complete(self, index: int) -> None:
        """A group whose samples are all done: released (or held) if every sample is within k versions of this
        batch's, else its stale samples run again (engines that a failed sync left behind sampled them)."""
        c = self.c
        with c.lock:
            stale = c.regenerate_stale(index, self.version, self.m)
        if stale:
            self.m.samples_regenerated_at_release += len(stale)
            self.queue.extendleft((index, j) for j in reversed(stale))
            return
        c.harvest(index, self.version, self.released, self.m, self.pinned, self.members, self.pending_pinned)

    def drain(self) -> None:
        """Pinned groups hold the rest of the batch: stop admitting, abort every unpinned sample."""
        c = self.c
        self.fill = False
        aborted = [rid for rid, (i, _) in self.running.items() if i not in self.pinned]
        for rid in aborted:
            index, j = self.running.pop(rid)
            c.engines[self.engine_of.pop(rid)].abort([rid])
            c.live[index].samples[j].status = SampleStatus.RESUMED
        self.queue = collections.deque((i, j) for i, j in self.queue if i in self.pinned)

    def replace_filtered(self) -> None:
        """Sync + dynamic sampling: replace each filtered group until U useful ones (or the cap)."""
        c, cfg = self.c, self.cfg
        target = cfg.update_groups - len(self.released)
        if cfg.release_cap:  # never release more than the cap, in flight included
            target = min(target, cfg.release_cap - len(self.released) - self.m.groups_filtered)
        before = len(c.live)
        c.admit(self.version, target)
        self.queue.extend(c.entries(list(c.live)[before:]))

    # ---- when it ends -------------------------------------------------------------------
    def pending_pinned(self) -> int:
        return sum(1 for i in self.pinned if i in self.c.live)

    def at_cap(self) -> bool:
        """Dynamic sampling's oversampling cap reached: as many groups released, useful or filtered."""
        cap = self.cfg.release_cap
        return bool(cap) and len(self.released) + self.m.groups_filtered >= cap

    def done(self) -> bool:
        cfg, useful = self.cfg, len(self.released)
        if cfg.mode == "sync":
            return not self.c.live
        if self.members is not None:
            return not any(i in self.c.live for i in self.members)
        if useful >= cfg.batch_bound:
            return True
        if self.pending_pinned():
            return False
        if self.at_cap():
            return True  # oversampling cap: train on the useful groups there are, none included (step skipped)
        if useful == 0:
            return False
        if cfg.token_budget and self.tokens >= cfg.token_budget:
            return True
        return useful >= cfg.update_groups

    def end(self) -> tuple[list[Group], PhaseMetrics]:
        """Abort what still runs (kept or discarded by mode), advance the clock, fill in the phase's metrics."""
        c, m = self.c, self.m
        c.end_phase(self.running, self.engine_of, m, len(self.released))
        if not c.keep_batch:  # (the batch leaves with this phase; kept: its caller hands it over, ``hand_over``)
            c.in_phase.clear()
        end = max(self.times) if self.times else c.clock
        m.duration = end - c.clock
        m.drain_s = end - self.drain_at if self.drain_at is not None else 0.0
        m.slot_time_total = sum(e.slots for e in c.engines) * m.duration
        if m.tokens_generated:  # (what a token costs a slot: the environments' time in tokens, ``expected.py``)
            c.token_s = m.slot_time_busy / m.tokens_generated
        c.clock = end
        m.buffer_groups = len(c.live)
        m.prompts_discarded_twice = sum(1 for g in c.live.values() if g.discards >= 2) + sum(
            1 for q in (c.requeued, c.long_queue) for _, d, _ in q if d >= 2)
        return c.batch_order(self.released), m
