"""Disaggregated engines on real parts: two vLLM replicas in their own processes, one trainer, one controller.

    python tests/workers/replica_checks.py RUN_DIR [key=value ...]

Builds the run's session (``engine.placement=disaggregated``), records every token event each
replica reports, and runs RL steps in partial mode. Then: a sync whose stream breaks after half
of its buckets (every replica keeps its old weights exactly), and a full sync (every replica's
logprobs equal the trainer's). Prints one JSON line. Every replica process is ended on exit.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers

from helpers.processes import record_drawn  # noqa: E402  (tests/ on the path first)


def main(run_dir: str, *overrides: str) -> None:
    import torch

    from megarl.config import load_config
    from megarl.session import build_session
    from megarl.train import rl_step
    from megarl.types import GenerationRequest
    from megarl.weight_sync.protocol import WeightSync, logprob_gap
    from megarl.weight_sync.streaming import StreamingSync, WeightsOverride, flat_buckets

    cfg = load_config("configs/demo.yaml", [
        f"train.run_dir={run_dir}", f"model.path={run_dir}/model", "engine.placement=disaggregated",
        "engine.replicas=2", "engine.kv_cache_gib=0.0625", "engine.slots=8", "rollout.mode=partial",
        "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=24",
        "data.eval_size=4", "optim.micro_batch_size=16", "sync.check_every=1", "sync.bucket_mib=0.25", *overrides])
    s = build_session(cfg)
    try:
        seen: list[tuple[int, int, int, int]] = []  # (step, replica, tokens, version the replica reported)
        phase_of = {"step": 0}
        for client in s.controller.engines:
            step = client.step

            def recorded(step=step, k=client.index):
                report = step()
                seen.extend((phase_of["step"], k, len(ev.token_ids), ev.version) for ev in report.events)
                return report

            client.step = recorded
        drawn = record_drawn(s.controller)
        versions, gaps, released = [], [], set()
        for step in range(cfg.train.steps):
            phase_of["step"] = step
            m = rl_step(s, step)
            versions.append(m.get("engine/version"))
            gaps.append(m.get("sync/logprob_gap"))
        released = set(s.controller.released)
        live = set(s.controller.live)
        requeued = {item.index for q in (s.controller.requeued, s.controller.long_queue) for item, *_ in q}
        # an interrupted sync, then a full one, checked on every replica
        vocab = s.hf_cfg["vocab_size"]
        g = torch.Generator().manual_seed(5)
        probe = [GenerationRequest(torch.randint(2, vocab, (6,), generator=g).tolist(), n=1, max_tokens=8, greedy=True)
                 for _ in range(3)]

        def outputs():
            return [[(c[0].token_ids, c[0].logprobs) for c in s.engines.generate(probe, seed=0, replica=k)]
                    for k in range(len(s.engines.clients))]

        from helpers.trainers import fixed_batch
        from megarl.algo.losses import ppo_clip_loss

        s.trainer.train_step(fixed_batch(vocab), lambda lp, mb: ppo_clip_loss(  # the trainer moves on, unsynced
            lp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"], 0.2, 0.28))
        gap_stale = logprob_gap(s.engines, s.trainer, seed=9)
        lines: list[str] = []
        proto = WeightSync(s.trainer, s.engines.dtype, cfg.sync.bucket_mib, say=lines.append)
        stream = StreamingSync.of(s.trainer, s.engines.dtype, cfg.sync.bucket_mib)
        total = len(stream.buckets())
        before = outputs()
        version_before = min(s.engines.served_versions())

        def broken():
            for name, t in stream.weights():
                if stream.stats.buckets > total // 2:
                    raise ConnectionError("injected: the link died after half of the buckets")
                yield name, t

        failed = proto.run(s.engines, version_before + 1, stream=WeightsOverride(stream, broken())).metrics()
        after = outputs()
        ok = proto.run(s.engines, version_before + 1).metrics()
        gap_each = [logprob_gap(_On(s.engines, k), s.trainer, seed=9) for k in range(len(s.engines.clients))]
        versions_after_ok = [c.weight_version for c in s.engines.clients]
        # a failure inside the replicas (a tensor of the wrong shape half-way): they keep receiving so the
        # group stays in step, restore their weights, and the next sync works
        from megarl.weight_sync.load import WeightLoadError

        s.trainer.train_step(fixed_batch(vocab), lambda lp, mb: ppo_clip_loss(
            lp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"], 0.2, 0.28))
        before_local = outputs()
        plan = stream.piece_plan()
        bad = [list(pieces) for pieces in plan]
        half, j = next((b, j) for b in range(len(bad) // 2, len(bad)) for j, (_, shape) in enumerate(bad[b])
                       if len(shape) == 2 and shape[0] != shape[1])
        name, shape = bad[half][j]
        bad[half][j] = (name, (shape[1], shape[0]))
        try:
            s.engines.update(bad, flat_buckets(stream.weights(), plan), min(s.engines.served_versions()) + 1)
            local_error = ""
        except WeightLoadError as exc:
            local_error = str(exc)
        unchanged_local = before_local == outputs()
        after_local = proto.run(s.engines, min(s.engines.served_versions()) + 1).metrics()
        gap_after_local = logprob_gap(s.engines, s.trainer, seed=11)
        resync = resync_checks(s, proto, stream, bad, outputs)
        print(json.dumps({
            "steps": cfg.train.steps, "versions": versions, "gaps": gaps, "events": seen,
            "drawn": sorted(drawn), "released": sorted(released), "live": sorted(live), "requeued": sorted(requeued),
            "buckets": total, "failed": failed, "log": lines, "unchanged_after_failure": before == after,
            "gap_stale": gap_stale,
            "version_before": version_before, "ok": ok, "gap_each_replica": gap_each,
            "replica_versions": versions_after_ok, "local_error": local_error,
            "unchanged_after_local_failure": unchanged_local, "after_local": after_local,
            "gap_after_local": gap_after_local, **resync,
        }), flush=True)
    finally:
        s.engines.close()


def resync_checks(s, proto, stream, bad, outputs) -> dict:
    """``sync.rollback=resync`` reaches the replicas: no backup; the same failure inside them leaves both
    unusable (they refuse to generate: batch, submit, step), and the next full sync repairs them."""
    from megarl.types import SlotRequest
    from megarl.weight_sync.load import EngineUnusable, WeightLoadError
    from megarl.weight_sync.protocol import logprob_gap
    from megarl.weight_sync.streaming import flat_buckets

    s.engines.rollback = "resync"
    version = min(s.engines.served_versions())
    try:
        s.engines.update(bad, flat_buckets(stream.weights(), stream.piece_plan()), version + 1)
        error = ""
    except WeightLoadError as exc:
        error = str(exc)
    unusable_versions = [c.weight_version for c in s.engines.clients]
    client, refused = s.engines.clients[1], []
    for attempt in (outputs, lambda: client.submit(SlotRequest("resync-probe", [3, 5, 7], 4)), client.step):
        try:
            attempt()
            refused.append("")
        except EngineUnusable as exc:
            refused.append(str(exc))
    repaired = proto.run(s.engines, version + 1).metrics()
    return {"resync_error": error, "resync_unusable_versions": unusable_versions, "resync_refused": refused,
            "resync_repaired": repaired, "resync_versions": [c.weight_version for c in s.engines.clients],
            "resync_gap": logprob_gap(s.engines, s.trainer, seed=13)}


class _On:
    """``generate`` on one given replica (for the per-replica audit)."""

    def __init__(self, replicas, k: int) -> None:
        self.replicas, self.k = replicas, k

    def generate(self, requests, seed):
        return self.replicas.generate(requests, seed, replica=self.k)


if __name__ == "__main__":
    main(*sys.argv[1:])
