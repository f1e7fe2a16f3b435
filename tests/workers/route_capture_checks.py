"""Routes captured from a real vLLM engine (``engines.routes``: CPU, or a GPU's), saved for the trainer's replay checks.

    python tests/workers/route_capture_checks.py MODEL_DIR OUT.pt DTYPE
    torchrun --nproc-per-node 2 tests/workers/route_capture_checks.py MODEL_DIR OUT.pt DTYPE 2   (GPUs: engine TP 2)

An engine of ``DTYPE`` (float32 / bfloat16) that captures routes samples 8 responses through the slot face the
controller drives; half of them are aborted after a few steps and resumed from their tokens (the partial
buffer's path: the resumed request re-prefills every earlier position, whose routes must stay those of the
first request; on a GPU the aborted request returns none, and the resumed one all). Saves the samples (prompt,
response, behaviour logprobs, routes) and prints what was checked.

With an engine TP (4th argument) > 1 under torchrun, the colocated engine over the ranks (``external_launcher``):
the first rank's samples carry the routes, the others' none, every rank samples the same tokens, and a batch
generation (evaluation's path) runs on every rank. Rank 0 prints.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch


def main(model_dir: str, out: str, dtype: str, tp: str = "1") -> None:
    import os

    import torch.distributed as dist

    from megarl.engines.vllm_engine import VLLMEngine, VLLMSlotEngine, set_cpu_engine_env

    set_cpu_engine_env(0.25)
    from megarl.distributed.parallel import init_process_group
    from megarl.engines.routes import step_samples
    from megarl.models.hf_config import num_experts, read_hf_config
    from megarl.types import GenerationRequest, Sample, SlotRequest

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = init_process_group()
    hf = read_hf_config(model_dir)
    engine = VLLMEngine(model_dir, max_model_len=64, kv_cache_gib=0.25, tensor_parallel_size=int(tp), seed=0,
                        max_num_seqs=8, dtype=dtype, route_experts=num_experts(hf))
    slots = VLLMSlotEngine(engine, slots=8)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, hf["vocab_size"], (5 + i % 3,), generator=g).tolist() for i in range(4)]
    samples = {f"{i}:{j}": Sample(prompt_ids=p) for i, p in enumerate(prompts) for j in range(2)}  # groups of 2

    def submit(rid: str, s: Sample, serial: int) -> str:
        request = f"{rid}:{serial}"
        slots.submit(SlotRequest(request, s.prompt_ids + s.response_ids, 24 - len(s.response_ids), 1.0))
        return request

    torch.manual_seed(0)
    running = {submit(k, s, 0): s for k, s in samples.items()}
    step_samples(slots, running, steps=4)
    interrupted = {}
    for request, s in list(running.items())[::2]:  # every other unfinished sample: aborted, resumed later
        slots.abort([request])
        del running[request]
        before = s.route_array()  # (None on a GPU: vLLM returns a request's routes when it finishes)
        interrupted[request] = (s, None if before is None else before.copy(), len(s.response_ids))
    step_samples(slots, running)
    resumed = {submit(request.rsplit(":", 1)[0], s, 1): s for request, (s, _, _) in interrupted.items()}
    step_samples(slots, resumed)
    tokens = [s.response_ids for s in samples.values()]
    routed = sum(s.route_array() is not None for s in samples.values())
    generated = [c.token_ids for o in engine.generate([GenerationRequest(p, max_tokens=8, greedy=True)
                                                       for p in prompts], seed=0) for c in o]
    every = [None] * world
    dist.all_gather_object(every, (tokens, routed, generated))
    if rank:
        return
    kept = all(before is None or np.array_equal(s.route_array()[:len(before)], before)
               for s, before, _ in interrupted.values())
    lengths_ok = all(len(s.route_array()) == len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples.values())
    first = next(iter(samples.values())).route_array()
    torch.save([dict(prompt=s.prompt_ids, response=s.response_ids, logprobs=s.logprobs, routes=s.route_array())
                for s in samples.values()], out)
    print(json.dumps({"samples": len(samples), "interrupted": len(interrupted), "kept": kept,
                      "lengths_ok": lengths_ok, "dtype": str(first.dtype), "shape": list(first.shape[1:]),
                      "prefix_caching": engine._args["enable_prefix_caching"], "eager": engine._args["enforce_eager"],
                      "capture": type(engine.routes).__name__,
                      "max_id": int(max(s.route_array().max() for s in samples.values())), "tp": int(tp),
                      "routed": [r for _, r, _ in every], "same_tokens": all(t == tokens for t, _, _ in every),
                      "same_generated": all(g == generated for *_, g in every) and len(generated) == 4}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
