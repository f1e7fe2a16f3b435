"""The adapter-only sync (``lora.rank`` > 0) into a disaggregated replica on real parts: a megatron-core trainer with
LoRA adapters (one process) → a vLLM CPU engine in a process of its own (``EngineReplicas``), served the adapters as
vLLM LoRA adapters registered from memory on each of its workers.

    python tests/workers/lora_replica_checks.py MODEL_DIR [TP]     (TP: the replica's, 1 or 2)

1. The trainer takes a step; the replica still serves the base: the audit's gap is large.
2. A sync whose adapter is broken (a lora_B a row short) is refused by the replica: it serves the base as before
   (greedy tokens and logprobs equal, exactly), version 0, the failure counted.
3. The sync then succeeds: version 1, replica ≈ trainer (the audit), the bytes moved against the full weights'.
4. Another step; a greedy request runs on the replica and, a few tokens in, the new adapters load in flight: the
   tokens before carry version 1, those after version 2, and those after are what the replica, idle and serving
   version 2, generates from the prompt and the tokens before (its KV recomputed under the new adapter, not the
   old one's kept), and not what version 1 gives.
5. The replica killed, a sync fails with every replica ended (the next phase restarts them), never a hang.
Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from workers.lora_sync_checks import broken_stream, checkpoint_elements, lora_trainer  # noqa: E402
from workers.protocol_checks import probe  # noqa: E402


def run_in_flight(replicas, proto, prompt: list[int], before: int, total: int) -> dict:
    """A greedy request of ``total`` tokens, the sync in flight after ``before`` of them; its tokens, logprobs and
    versions, and how many came before the load."""
    from megarl.types import SlotRequest

    client = replicas.clients[0]
    client.submit(SlotRequest("r", list(prompt), total, temperature=0.0))
    tokens, logprobs, versions, report, grown = [], [], [], None, 0
    while True:
        events = client.step().events
        for ev in events:
            tokens += ev.token_ids
            logprobs += ev.logprobs
            versions += [ev.version] * len(ev.token_ids)
        if any(ev.finished for ev in events):
            break
        if report is None and len(tokens) >= before:
            grown = len(tokens)
            report = proto.run(replicas, 2, in_flight=True).metrics()
    assert report is not None, f"the request ended after {len(tokens)} tokens, before the load"
    return {"tokens": tokens, "logprobs": logprobs, "versions": versions, "grown": grown, "report": report}


def main(model_dir: str, tp: str = "1") -> None:
    from megarl.config.schema import LoraConfig
    from megarl.distributed.parallel import init_process_group
    from megarl.engines.remote.replicas import EngineReplicas
    from megarl.types import GenerationRequest
    from megarl.weight_sync.protocol import WeightSync, logprob_gap

    replicas = EngineReplicas(model_dir, 1, int(tp), 64, 0.0625, 4, lora_rank=4)
    init_process_group()
    ps, cfg, trainer, step = lora_trainer("single", model_dir, LoraConfig(rank=4, alpha=8.0))
    Broken = broken_stream(ps)
    lines: list[str] = []
    try:
        proto = WeightSync(trainer, replicas.dtype, bucket_mib=1, check_every=1, say=lines.append)
        step()
        base = probe(replicas, cfg["vocab_size"])
        gap_base = logprob_gap(replicas, trainer, seed=3)
        failed = proto.run(replicas, 1, stream=Broken.of(trainer, replicas.dtype)).metrics()
        after_failure = probe(replicas, cfg["vocab_size"])
        ok = proto.run(replicas, 1).metrics()
        prompt = [3, 5, 7, 11, 13, 17, 19, 23]
        v1 = replicas.generate([GenerationRequest(prompt, n=1, max_tokens=16, greedy=True)], seed=0)[0][0]
        step()
        flight = run_in_flight(replicas, proto, prompt, before=4, total=16)
        grown = flight["grown"]
        rest = len(flight["tokens"]) - grown
        idle = replicas.generate([GenerationRequest(prompt + flight["tokens"][:grown], n=1, max_tokens=rest,
                                                    greedy=True)], seed=0)[0][0]
        gap_v2 = logprob_gap(replicas, trainer, seed=5)
        replicas.clients[0].proc.kill()
        replicas.clients[0].proc.join(10)
        died = proto.run(replicas, 3).metrics()
    finally:
        replicas.close()
    print(json.dumps({
        "gap_base": gap_base, "failed": failed, "log": lines,
        "same_tokens": [a[0] for a in base] == [b[0] for b in after_failure],
        "logprob_diff_after_failure": max(abs(x - y) for a, b in zip(base, after_failure) for x, y in zip(a[1], b[1])),
        "ok": ok, "flight": flight, "idle_tokens": idle.token_ids, "idle_logprobs": idle.logprobs, "gap_v2": gap_v2,
        "v1_tokens": v1.token_ids, "v1_logprobs": v1.logprobs,
        "died": died, "full_bytes": checkpoint_elements(model_dir) * replicas.dtype.itemsize,
    }), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
