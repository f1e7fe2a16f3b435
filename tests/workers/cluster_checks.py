"""Disaggregated engines fed by two trainer processes, on real parts (run under torchrun, 2 processes).

    torchrun --nproc-per-node 2 tests/workers/cluster_checks.py RUN_DIR [key=value ...]

Two vLLM replicas in processes of their own; the trainer at PP=2 (or whatever the overrides
say). Rank 0 drives the replicas; each trainer rank sends the buckets of its own layers.
1. RL steps in partial mode with the audit on every sync (engine vs trainer logprobs).
2. A replica is SIGKILLed while rank 0 is broadcasting a sync: the sync fails without hanging
   (every replica is ended), the next step's phase fails, the keeper restarts the replicas and
   gives them the trainer's weights, and the step completes.
3. Each replica's logprobs equal the trainer's afterwards.
Rank 0 prints one JSON line with every rank's results.

    torchrun --nproc-per-node N tests/workers/cluster_checks.py layout RUN_DIR [key=value ...] [hf=NAME]

One trainer layout (TP=2, PP=2×VPP=2, EP=2, DP=2 on 2 processes; TP=2×PP=2, EP=2×PP=2, EP=2×TP=2 on 4)
→ disaggregated replicas (at any ``engine.tensor_parallel_size``): see ``layout``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers


def main(run_dir: str, *overrides: str) -> None:
    import torch.distributed as dist

    from megarl.config import load_config
    from megarl.distributed import collectives as cluster
    from megarl.keeper import RunKeeper
    from megarl.session import build_session
    from megarl.train import rl_step
    from megarl.weight_sync.protocol import logprob_gap
    from megarl.weight_sync.streaming import StreamingSync

    cfg = load_config("configs/demo.yaml", [
        f"train.run_dir={run_dir}", f"model.path={run_dir}/model", "engine.placement=disaggregated",
        "engine.replicas=2", "engine.kv_cache_gib=0.0625", "engine.slots=8", "rollout.mode=partial",
        "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=16",
        "data.eval_size=4", "optim.micro_batch_size=16", "sync.check_every=1", "sync.bucket_mib=0.25",
        "sync.timeout_s=120", "parallel.pp=2", "engine.max_restarts=2", *overrides])
    s = build_session(cfg)
    rank = dist.get_rank()
    try:
        keeper = RunKeeper(s)
        keeper.resume()
        steps = []
        for step in range(2):
            m = rl_step(s, step, keeper)
            steps.append({k: m.get(k) for k in ("engine/version", "sync/logprob_gap", "sync/failures", "sync/bytes",
                                                "sync/sent_bytes", "sync/peak_extra_mib", "reward/mean")})
        senders, sent_by_rank = s.engines.senders, s.engines.sent_by_rank
        # a replica killed mid-broadcast: rank 0 kills replica 1 after sending two of its buckets
        if rank == 0:
            plain = StreamingSync.owned_buckets

            def killing(sync):
                for i, bucket in enumerate(plain(sync)):
                    if i == 2:
                        os.kill(s.engines.clients[1].proc.pid, signal.SIGKILL)
                    yield bucket

            StreamingSync.owned_buckets = killing
        start = time.perf_counter()
        killed = rl_step(s, 2, keeper)
        killed_s = time.perf_counter() - start
        if rank == 0:
            StreamingSync.owned_buckets = plain
        alive_after_kill = [c.proc.is_alive() for c in s.engines.clients]
        after = rl_step(s, 3, keeper)  # its phase hits the dead replicas: the keeper restarts them
        gaps = [logprob_gap(_On(s.engines, k), s.trainer, seed=9) for k in range(2)]
        mine = {"steps": steps, "senders": senders, "sent_by_rank": sent_by_rank,
                "killed": {k: killed.get(k) for k in ("sync/failures", "engine/version")}, "killed_s": killed_s,
                "alive_after_kill": alive_after_kill, "restarts": keeper.faults.restarts,
                "after": {k: after.get(k) for k in ("sync/failures", "engine/version", "sync/logprob_gap",
                                                     "faults/engine_restarts")},
                "gaps": gaps, "versions": s.engines.versions}
        ranks = cluster.gather(mine)
        if rank == 0:
            print(json.dumps({"ranks": ranks}), flush=True)
    finally:
        s.engines.close()


class _On:
    """``generate`` on one given replica (for the per-replica audit; collective like the engine's)."""

    def __init__(self, replicas, k: int) -> None:
        self.replicas, self.k = replicas, k

    def generate(self, requests, seed):
        return self.replicas.generate(requests, seed, replica=self.k)


def replica_tp(run_dir: str, *overrides: str) -> None:
    """One trainer process, one replica at TP=2 (two vLLM workers, both in the transfer group): RL steps
    with the audit after every sync, then a sync broken half-way (the replica keeps its weights)."""
    from megarl.config import load_config
    from megarl.session import build_session
    from megarl.train import rl_step
    from megarl.weight_sync.protocol import WeightSync
    from megarl.weight_sync.streaming import StreamingSync, WeightsOverride

    cfg = load_config("configs/demo.yaml", [
        f"train.run_dir={run_dir}", f"model.path={run_dir}/model", "engine.placement=disaggregated",
        "engine.replicas=1", "engine.tensor_parallel_size=2", "engine.kv_cache_gib=0.0625", "engine.slots=8",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=16", "data.eval_size=4",
        "optim.micro_batch_size=8", "sync.check_every=1", "sync.bucket_mib=0.25", *overrides])
    s = build_session(cfg)
    try:
        steps = [rl_step(s, step) for step in range(2)]
        stream = StreamingSync.of(s.trainer, s.engines.dtype, cfg.sync.bucket_mib)
        total, lines = len(stream.buckets()), []

        def broken():
            for name, t in stream.weights():
                if stream.stats.buckets > total // 2:
                    raise ConnectionError("injected: the link died after half of the buckets")
                yield name, t

        proto = WeightSync(s.trainer, s.engines.dtype, cfg.sync.bucket_mib, check_every=1, say=lines.append)
        failed = proto.run(s.engines, 3, stream=WeightsOverride(stream, broken())).metrics()
        ok = proto.run(s.engines, 3).metrics()
        print(json.dumps({"gaps": [m["sync/logprob_gap"] for m in steps],
                          "versions": [m["engine/version"] for m in steps],
                          "failed": failed, "log": lines, "ok": ok}), flush=True)
    finally:
        s.engines.close()


def layout(run_dir: str, *overrides: str) -> None:
    """The trainer processes at the layout the overrides give (e.g. TP=2, PP=2×VPP=2, EP=2, TP=2×PP=2) → disaggregated
    replicas: RL steps with the audit after every sync, the stale gap before the last sync, each replica's gap
    at the end, and what each trainer rank wrote into buckets of its own, TP-gathered and sent (``hf=NAME``: a
    model written by transformers, ``tests/helpers/hf_models.py``, e.g. ``hf=qwen3_tied`` with a tied LM head)."""
    import torch.distributed as dist

    from megarl.config import load_config
    from megarl.distributed import collectives as cluster
    from megarl.session import build_session
    from megarl.train import rl_step
    from megarl.trainer.sft import supervised_warmup, task_examples
    from megarl.weight_sync import streaming
    from megarl.weight_sync.protocol import logprob_gap

    hf = [o.split("=", 1)[1] for o in overrides if o.startswith("hf=")]
    overrides = tuple(o for o in overrides if not o.startswith("hf="))
    if hf:  # written by rank 0 before the session starts (no process group yet: a marker file)
        from helpers.hf_models import make_hf_model

        marker = f"{run_dir}/model.done"
        if int(os.environ.get("RANK", "0")) == 0:
            make_hf_model(f"{run_dir}/model", hf[0], seed=3)
            open(marker, "w").close()
        while not os.path.exists(marker):
            time.sleep(0.2)
    cfg = load_config("configs/demo.yaml", [
        f"train.run_dir={run_dir}", f"model.path={run_dir}/model", "engine.placement=disaggregated",
        "engine.replicas=1", "engine.kv_cache_gib=0.0625", "engine.slots=8", "rollout.mode=partial",
        "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=16",
        "data.eval_size=4", "optim.micro_batch_size=8", "sync.check_every=1", "sync.bucket_mib=0.0625",
        "sync.timeout_s=300", "algo.entropy_coef=0.01", *(["model.make_tiny="] if hf else []), *overrides])
    s = build_session(cfg)
    rank, steps_n = dist.get_rank(), 3
    # the plan entries this rank filled into a bucket of its own / TP-gathered onto itself / gave its TP shard of
    wrote, gathered, gave = set(), set(), set()
    plain_fill = streaming.StreamingSync._fill

    def recorded_fill(sync, e, out):
        extra = plain_fill(sync, e, out)
        if extra:
            gathered.add(e.name)
        if out.numel():
            wrote.add(e.name)
        if sync._local[e.name].dim is not None and sync._leader[e.name] == e.source != rank:
            gave.add(e.name)
        return extra

    streaming.StreamingSync._fill = recorded_fill
    stale, run_sync = [], s.weight_sync.run

    def sync_after_gap(engines, version, in_flight=False, stream=None):  # the engines' gap measured before each sync
        stale.append(logprob_gap(engines, s.trainer, seed=50 + version))
        return run_sync(engines, version, in_flight, stream)

    s.weight_sync.run = sync_after_gap
    try:  # a short supervised warm-up first: the trainer moves away from the checkpoint the replicas load
        supervised_warmup(s.trainer, s.tokenizer, task_examples(s.task, s.tokenizer), 2, 16, 3e-3,
                          log=lambda *a, **k: None)
        steps = []
        for step in range(steps_n):
            m = rl_step(s, step)
            steps.append({k: m.get(k) for k in ("engine/version", "sync/logprob_gap", "sync/failures", "sync/bytes",
                                                "sync/sent_bytes", "loss/grad_norm")})
        gaps = [logprob_gap(_On(s.engines, k), s.trainer, seed=9) for k in range(cfg.engine.replicas)]
        sync = s.weight_sync.stream  # the stream the last sync sent
        mine = {"senders": s.engines.senders, "sent_by_rank": s.engines.sent_by_rank, "wrote": sorted(wrote),
                "gathered": sorted(gathered), "gave": sorted(gave), "local": sorted(sync._local),
                "peak_extra": sync.stats.peak_extra_bytes}
        ranks = cluster.gather(mine)
        if rank == 0:
            plan = [(e.name, e.source, e.numel * sync.dtype.itemsize) for e in sync.plan()]
            print(json.dumps({"steps": steps, "stale": stale, "gaps": gaps, "versions": s.engines.versions,
                              "plan": plan, "ranks": ranks, "tied": bool(s.trainer.hf_cfg.get("tie_word_embeddings")),
                              "dispatcher": s.trainer.tcfg.moe_token_dispatcher_type}),
                  flush=True)
    finally:
        s.engines.close()


if __name__ == "__main__":
    if sys.argv[1] == "replica_tp":
        replica_tp(*sys.argv[2:])
    elif sys.argv[1] == "layout":
        layout(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
