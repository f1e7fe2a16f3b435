"""Routes through vLLM preempting requests mid-prefill (``engines.routes``), on a real vLLM CPU engine.

    python tests/workers/route_preemption_checks.py MODEL_DIR BLOCKS

A KV cache of ``BLOCKS`` blocks of 32 tokens, a batched-token budget (64) shorter than every prompt and more
slots than the cache holds: vLLM's scheduler preempts the newest requests when a running one needs a block, and
one preempted mid-prefill, with rows held by the capture and no output yet, starts again from position 0. The
same prompts are then run one at a time (nothing preempted) as the reference. Prints what was checked. On a GPU
(``tests/gpu/``) the same through vLLM's own route output, with CUDA graphs.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch


def run(llm, routes, prompts: dict, max_tokens: int) -> tuple[dict, int]:
    """Every prompt's sample (greedy) through the slot face's bookkeeping (``VLLMSlotEngine.step``); the most
    times vLLM preempted one request."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from megarl.types import Sample

    engine, samples = llm.llm_engine, {}
    scheduler = engine.engine_core.engine_core.scheduler
    for rid, p in prompts.items():
        samples[rid] = Sample(prompt_ids=p)
        engine.add_request(rid, TokensPrompt(prompt_token_ids=p), SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0, detokenize=False,
            output_kind=RequestOutputKind.DELTA))
    preempted = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        preempted = max([preempted, *(r.num_preemptions for r in scheduler.requests.values())])
        routes.collect()
        for out in outputs:
            s = samples[out.request_id]
            s.response_ids += list(out.outputs[0].token_ids)
            first, new = routes.take(out)
            if new is not None:
                s.add_routes(first, new)
    return samples, preempted


def main(model_dir: str, blocks: int) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override num_gpu_blocks_override's cache
    from vllm import LLM

    from megarl.distributed.parallel import init_process_group
    from megarl.engines.routes import capture_args, route_capture
    from megarl.models.hf_config import num_experts, read_hf_config

    init_process_group()
    hf, gpu = read_hf_config(model_dir), torch.cuda.is_available()
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=not gpu, max_model_len=256, seed=0,
              distributed_executor_backend="external_launcher", max_num_seqs=12, max_num_batched_tokens=64,
              num_gpu_blocks_override=blocks, block_size=32, kv_cache_memory_bytes=64 << 20,
              async_scheduling=False, **capture_args(num_experts(hf), gpu))
    routes = route_capture(llm, model_dir, gpu)  # (on a GPU vLLM's own route output: CUDA graphs, prefix caching)
    g = torch.Generator().manual_seed(1)
    prompts = {str(i): torch.randint(2, hf["vocab_size"], (120 + 9 * i,), generator=g).tolist() for i in range(10)}
    together, preempted = run(llm, routes, prompts, 8)
    restarts = routes.restarts
    alone = {}
    for rid, p in prompts.items():
        alone.update(run(llm, routes, {rid: p}, 8)[0])
    ok = all(len(s.route_array()) == len(s.prompt_ids) + len(s.response_ids) - 1 for s in together.values())
    print(json.dumps({
        "preempted": preempted, "restarts": restarts, "lengths_ok": ok, "layers": routes.layer_ids,
        "same_tokens": all(together[r].response_ids == alone[r].response_ids for r in prompts),
        "same_routes": all(np.array_equal(together[r].route_array(), alone[r].route_array()) for r in prompts),
        "shape": list(together["0"].route_array().shape[1:]), "prefix_caching": llm.llm_engine.vllm_config.
        cache_config.enable_prefix_caching}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
