"""One weight sync, named and ordered: pause → stream + load (+ MoE repack) → reset prefix cache → bump version →
resume.

::

    PAUSE        the engines have no request in flight (partial mode: the controller ended the phase
                 and put unfinished samples in its buffer; anything still running is an error,
                 raised before a byte moves), unless the sync is in flight (``rollout.overlap: async``)
    STREAM+LOAD  buckets leave the trainer layer by layer (``streaming.StreamingSync``) and are
                 loaded as they arrive (``load.load_or_restore``, or a replica's ``vllm_backend``: all or
                 nothing — a failure restores the engine's previous weights from a host copy)
    REPACK       the fused-MoE experts' processing and the tied-head repack vLLM 0.32 skips in a reload
                 (inside the load)
    RESET_CACHE  the prefix cache is dropped (its KV was computed under the old weights)
    BUMP         the engines' served version = the trainer's; every token they sample carries it
    RESUME       the engines accept requests again
    AUDIT        every ``sync.check_every`` syncs: engine vs trainer logprobs on a probe batch
                 (``sync/logprob_gap``), the check that catches a silent layout bug; an engine error in
                 it (a replica that died) propagates: the keeper restarts the engines, syncs again and
                 the audit, still owed, runs again

The engines carry out PAUSE to RESUME (``Engines.load``, one call); this module streams, counts and audits.
A failed sync is contained: the engines keep serving the old version (never a mix), the failure is
logged and counted (``sync/failures``), and the next sync streams the whole model again. ``engine/version``
is logged after every sync. With ``sync.rollback: resync`` (no backup copy) a failed load leaves the
engine unusable instead: ``engine/version`` is ``UNUSABLE`` (-1), generating on it raises
``EngineUnusable``, and the next phase's engine-error path (restart or recover, then a full sync) or
simply the next successful sync repairs it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.algo.batch import build_batch
from megarl.distributed.watchdog import guard
from megarl.types import GenerationRequest
from megarl.weight_sync.adapters import stream_of
from megarl.weight_sync.load import LoadReport, WeightLoadError
from megarl.weight_sync.streaming import SyncStats

log = logging.getLogger(__name__)


class Stage(enum.Enum):
    PAUSE = "pause"
    STREAM_LOAD = "stream+load"
    RESET_CACHE = "reset_prefix_cache"
    BUMP = "bump_version"
    RESUME = "resume"
    AUDIT = "audit"


ORDER = (Stage.PAUSE, Stage.STREAM_LOAD, Stage.RESET_CACHE, Stage.BUMP, Stage.RESUME)


@dataclass
class SyncReport:
    """One sync's outcome; ``metrics`` gives it under the names the logs use."""

    version: int
    """The version asked for."""
    served: int
    """The version the engines serve after it (the lowest over replicas; ``UNUSABLE`` for none)."""
    loaded: bool
    """Every engine loaded ``version`` (False: a contained failure, counted in ``failures``)."""
    seconds: float
    failures: int
    """Failed syncs over the run so far (``sync/failures``)."""
    in_flight: bool = False
    """Loaded between two engine steps with requests running (``rollout.overlap: async``)."""
    load: LoadReport | None = None
    stream: SyncStats | None = None
    logprob_gap: float | None = None
    """The audit's figure, when one ran."""

    def metrics(self) -> dict[str, float]:
        out = {**(self.load.metrics() if self.load else {}), **(self.stream.metrics() if self.stream else {})}
        out["timing/sync_s"] = self.seconds
        if self.logprob_gap is not None:
            out["sync/logprob_gap"] = self.logprob_gap
        out.update({"sync/failures": float(self.failures), "engine/version": float(self.served),
                    "sync/in_flight": float(self.in_flight)})
        return out


def logprob_gap(engines, trainer, seed: int = 0, prompts: int = 4, tokens: int = 8) -> float:
    """Max |engine − trainer| logprob over the sampled tokens of a small seeded probe batch (every rank calls it;
    colocated replicas share the probe out, so every replica's tokens are scored)."""
    vocab = int(trainer.hf_cfg["vocab_size"])
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(2, vocab, (6,), generator=g).tolist() for _ in range(prompts)]
    temp = float(getattr(trainer, "temperature", 1.0))
    outs = engines.generate([GenerationRequest(p, n=1, max_tokens=tokens, temperature=temp) for p in ids], seed=seed)
    batch = build_batch(ids, [o[0].token_ids for o in outs], [o[0].logprobs for o in outs])
    return float(((trainer.logprobs(batch) - batch.old_logprobs) * batch.loss_mask).abs().max())


class WeightSync:
    """The sync of one trainer's weights into a run's engines (``Engines``): the stages of ``ORDER``, the failures
    counted, the audit every ``check_every`` syncs; ``say`` gets one line per contained failure
    (a warning on every rank unless the caller says otherwise)."""

    def __init__(self, trainer, dtype: torch.dtype, bucket_mib: float, check_every: int = 0,
                 say: Callable[[str], None] | None = None) -> None:
        self.trainer, self.check_every = trainer, check_every
        self.stream = stream_of(trainer, dtype, bucket_mib)  # (its adapters alone, with LoRA)
        self.say = say or (lambda line: log.warning(line))
        self.failures = 0
        self.syncs = 0
        self.audit_owed = False  # an audit that an engine error interrupted: the next complete sync runs it
        self.stages: list[Stage] = []  # the stages the last sync went through, in order

    def run(self, engines, version: int, in_flight: bool = False, stream=None) -> SyncReport:
        """Sync the trainer's weights (or ``stream``'s, e.g. a test's ``WeightsOverride``) as ``version``.
        ``in_flight``: between two engine steps, requests running on; the audit, which needs idle engines, is
        owed to the next sync that has them."""
        start, load, stats = time.perf_counter(), None, None
        self.stages = [Stage.PAUSE, Stage.STREAM_LOAD]
        with guard(f"weight sync to version {version}"):  # a wedged collective ends the process (exit 75)
            try:
                load = engines.load(stream or self.stream, version, in_flight)
                self.stages += [Stage.RESET_CACHE, Stage.BUMP]
                self.syncs += 1
                stats = (stream or self.stream).stats
            except WeightLoadError as exc:
                self.failures += 1
                served = min(engines.served_versions())
                now = f"engine still serves version {served}" if served >= 0 else "engine unusable until re-synced"
                self.say(f"weight sync to version {version} failed; {now}: {exc}")
            finally:
                self.stages.append(Stage.RESUME)
            seconds, gap = time.perf_counter() - start, None
            due = self.check_every and self.syncs and (self.syncs % self.check_every == 0 or self.audit_owed)
            if due and in_flight:
                self.audit_owed = True
            elif due and load is not None:
                self.stages.append(Stage.AUDIT)
                self.audit_owed = True  # until it completes
                gap = self.audit(engines, version)
                self.audit_owed = False
        return SyncReport(version, min(engines.served_versions()), load is not None, seconds, self.failures,
                          in_flight, load, stats, gap)

    def audit(self, engines, version: int) -> float:
        """The engines' logprobs against the trainer's on a probe batch seeded by ``version``."""
        return logprob_gap(engines, self.trainer, seed=version)

    def state_dict(self) -> dict:
        return {"failures": self.failures}

    def load_state_dict(self, state: dict) -> None:
        self.failures = state.get("failures", 0)
