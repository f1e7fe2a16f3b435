"""A weight update that lands while a request runs (``rollout.overlap=async``): the request's next token comes from the
new weights alone, KV included.

    python tests/workers/inflight_checks.py WORKDIR

One disaggregated replica (a process of its own) starts from model A and decodes a greedy request; after a few
tokens, model B's weights (A perturbed) are loaded in flight. The token after the load, with its logprob, must equal
what the replica, idle and serving B, gives for the same prompt and the tokens so far as a new request (its KV all
computed under B; the prefix cache was dropped at the load).
Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(workdir: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from megarl.engines.remote.replicas import EngineReplicas
    from megarl.models.tiny import TinyShape, make_tiny_model
    from megarl.types import GenerationRequest, SlotRequest

    work = Path(workdir)
    a = make_tiny_model(work / "a", TinyShape(family="qwen2"), seed=3)
    b = make_tiny_model(work / "b", TinyShape(family="qwen2"), seed=3)
    weights = load_file(str(b / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    weights = {n: t + 0.05 * torch.randn(t.shape, generator=g) * t.float().std().clamp(min=1e-3)
               for n, t in weights.items()}
    save_file(weights, str(b / "model.safetensors"))
    prompt, before = [3, 5, 7, 11, 13, 17, 19, 23], 6
    replicas = EngineReplicas(str(a), 1, 1, 64, 0.0625, 4)
    try:
        client = replicas.clients[0]
        client.submit(SlotRequest("r", list(prompt), 24, temperature=0.0))
        tokens, logprobs, versions = [], [], []
        while len(tokens) < before:
            for ev in client.step().events:
                tokens += ev.token_ids
                logprobs += ev.logprobs
                versions += [ev.version] * len(ev.token_ids)
        plan = [[(n, tuple(t.shape))] for n, t in weights.items()]
        report = replicas.update(plan, iter([t.reshape(-1).contiguous() for t in weights.values()]), version=1,
                                 in_flight=True)
        grown = len(tokens)
        while len(tokens) == grown:
            for ev in client.step().events:
                tokens += ev.token_ids
                logprobs += ev.logprobs
                versions += [ev.version] * len(ev.token_ids)
        client.abort(["r"])
        out = replicas.generate([GenerationRequest(prompt + tokens[:grown], n=1, max_tokens=1, greedy=True)],
                                seed=0)[0][0]
    finally:
        replicas.close()
    print(json.dumps({"tokens_before_update": grown, "versions": versions, "backup_mib": report.backup_mib,
                      "after": [tokens[grown], logprobs[grown]], "fresh": [out.token_ids[0], out.logprobs[0]]}),
          flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
