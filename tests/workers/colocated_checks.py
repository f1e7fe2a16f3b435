"""Colocated engine replicas on real parts: the trainer over N processes, engine TP < N → N/TP replicas.

    torchrun --nproc-per-node 2 tests/workers/colocated_checks.py RUN_DIR [key=value ...]

Builds the run's session with the real ``build_session`` (colocated placement, e.g.
``parallel.tp=2 engine.tensor_parallel_size=1``), records on every rank the requests its own
engine was given and every token event it reported, then:

- a supervised warm-up; each rank's engine logprobs vs the trainer's before the sync (stale)
  and after it (``helpers.trainers.rank_gaps``: every rank's engine, each probe scored by the whole trainer);
- RL steps in partial mode through ``train.rl_step`` (its sync audits every rank's engine,
  ``sync.check_every=1``), keeping a digest of each phase's released groups (tokens, behaviour
  logprobs, versions, rewards) and of the controller's buffer;
- the same prompt submitted to two replicas right after one reseed: the samples must differ
  (each replica samples from a stream of its own);
- evaluation through the session's ``engines``: each replica generates its share, the result equals one engine's;
- an engine error on one replica: raised on every rank, no request left in flight;
- a reward that answers differently per rank, through ``shared_rewards``: every rank gets rank 0's.

Every rank's records are gathered; rank 0 prints one JSON line.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers

from helpers.processes import record_drawn  # noqa: E402  (tests/ on the path first)


def digest(rows) -> str:
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]


def main(run_dir: str, *overrides: str) -> None:
    import torch
    import torch.distributed as dist

    from helpers.trainers import rank_gaps
    from megarl.checkpoint.session_state import buffer_digest
    from megarl.config import load_config
    from megarl.engines.colocated import ColocatedReplicas
    from megarl.rollout.scoring import shared_rewards
    from megarl.session import build_session
    from megarl.train import rl_step
    from megarl.trainer.sft import supervised_warmup, task_examples
    from megarl.types import SlotRequest

    cfg = load_config("configs/demo.yaml", [
        f"train.run_dir={run_dir}", f"model.path={run_dir}/model", "model.make_tiny=qwen2",
        "engine.tensor_parallel_size=1", "parallel.tp=2", "engine.kv_cache_gib=0.25", "engine.slots=8",
        "engine.max_model_len=96", "rollout.mode=partial", "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=24", "data.max_digits=2", "data.eval_size=4",
        "optim.micro_batch_size=16", "sync.check_every=1", "sync.bucket_mib=0.25", "warmup.steps=2",
        "warmup.batch_size=16", "algo.entropy_coef=0.01", "train.steps=2", "train.time_limit_s=0", *overrides])
    s = build_session(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    face = s.controller.engines[0]
    assert isinstance(face, ColocatedReplicas), type(face)
    local = face.local
    given: list[str] = []  # request ids this rank's engine was given
    events: list[tuple[int, int, int]] = []  # (phase step, tokens, version the engine reported)
    phase = {"step": -1}
    submit, step = local.submit, local.step

    def recorded_submit(request):
        given.append(request.request_id)
        submit(request)

    def recorded_step():
        report = step()
        events.extend((phase["step"], len(ev.token_ids), ev.version) for ev in report.events)
        return report

    local.submit, local.step = recorded_submit, recorded_step
    drawn = record_drawn(s.controller)
    released_digests, run_phase = [], s.controller.run_phase

    routed = []  # per phase: (samples with routes, samples) of the released groups (MoE: rank 0 alone keeps them)

    def recorded_phase(version):
        groups, m = run_phase(version=version)
        samples = [x for g in groups for x in g.samples]
        routed.append((sum(x.routes is not None for x in samples), len(samples)))
        released_digests.append(digest([(g.prompt_index, [(x.response_ids, x.logprobs, x.versions, x.reward)
                                                          for x in g.samples]) for g in groups]))
        return groups, m

    s.controller.run_phase = recorded_phase

    supervised_warmup(s.trainer, s.tokenizer, task_examples(s.task, s.tokenizer), cfg.warmup.steps,
                      cfg.warmup.batch_size, cfg.warmup.lr, log=lambda *a, **k: None)
    own = s.engines.engine  # this rank's engine
    gap_stale = rank_gaps(own, s.trainer, seed=3)  # the engines still hold the checkpoint
    s.weight_sync.run(s.engines, 0)
    gap_synced = rank_gaps(own, s.trainer, seed=4)
    audits, versions, grad_norms, stale = [], [], [], []
    run_sync = s.weight_sync.run

    def sync_after_gap(engines, version, in_flight=False, stream=None):  # the loop's sync, the gap measured first
        stale.append(max(rank_gaps(own, s.trainer, seed=100 + version)))
        return run_sync(engines, version, in_flight, stream)

    s.weight_sync.run = sync_after_gap
    for k in range(cfg.train.steps):
        phase["step"] = k
        m = rl_step(s, k)
        audits.append(m["sync/logprob_gap"])  # after the step's training and sync, every rank's engine
        versions.append(m["engine/version"])
        grad_norms.append(m.get("loss/grad_norm", 0.0))
    c = s.controller
    requeued = sorted(item.index for q in (c.requeued, c.long_queue) for item, *_ in q)
    live_versions = [x.versions for g in c.live.values() for x in g.samples]

    # the same prompt on two replicas right after one reseed: two different samples
    torch.manual_seed(12345)
    before, submitted, phase_events = len(given), list(face.submitted), len(events)
    prompt = s.tokenizer("1+2=", add_special_tokens=False)["input_ids"]
    for j in range(face.replicas):
        face.submit(SlotRequest(f"same:{j}", list(prompt), 16, temperature=1.0))
    tokens: dict[str, list[int]] = {}
    while face.num_active():
        for ev in face.step().events:
            tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
    same_prompt = [tokens[f"same:{j}"] for j in range(face.replicas)]

    # evaluation shared out: each replica generates its share, every rank gets all of it, as one engine gives
    from megarl.types import GenerationRequest

    probe = [GenerationRequest(p.ids, max_tokens=12, greedy=True) for p in s.eval_prompts]
    counted, engine_generate = [], own.generate

    def counted_generate(requests, seed):
        counted.append(len(requests))
        return engine_generate(requests, seed)

    own.generate = counted_generate
    shared_out = [[c.token_ids for c in o] for o in s.engines.generate(probe, seed=0)]
    whole = [[c.token_ids for c in o] for o in own.generate(probe, seed=0)]
    own.generate = engine_generate

    # an engine error on the last replica only: every rank raises it after the step's exchange
    def failing_step():
        raise RuntimeError("engine fault on purpose")

    if face.replica == face.replicas - 1:
        local.step = failing_step
    for j in range(face.replicas):
        face.submit(SlotRequest(f"fail:{j}", list(prompt), 4, temperature=1.0))
    try:
        face.step()
        step_error = ""
    except RuntimeError as exc:
        step_error = str(exc)
    face.abort([f"fail:{j}" for j in range(face.replicas)])

    class RankReward:  # answers differently on each rank, as a reward that times out on one rank would
        def score(self, items):
            return [float(rank)] * len(items)

    shared_score = shared_rewards(RankReward()).score([("3", "3", {})])
    record = {"rank": rank, "replica": face.replica, "given": given[:before], "events": events[:phase_events],
              "submitted": submitted, "released": released_digests, "buffer": buffer_digest(c.state_dict()),
              "drawn": sorted(drawn), "released_ids": sorted(c.released), "live": sorted(c.live),
              "requeued": requeued, "live_versions": live_versions, "shared_score": shared_score,
              "eval_same": shared_out == whole, "eval_counts": counted, "step_error": step_error,
              "left": face.num_active(), "routed": routed}
    every = [None] * world
    dist.all_gather_object(every, record)
    if rank == 0:
        print(json.dumps({"world": world, "engine_tp": cfg.engine.tensor_parallel_size, "replicas": face.replicas,
                          "gap_stale": gap_stale, "gap_synced": gap_synced, "stale_before_sync": stale,
                          "audits": audits, "versions": versions,
                          "grad_norms": grad_norms, "same_prompt": same_prompt, "ranks": every}), flush=True)
    dist.barrier()
    s.rewards.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
    from helpers.processes import end_process_group  # (tests/ is on the worker's path)
    end_process_group()  # gloo ended before the interpreter's teardown
