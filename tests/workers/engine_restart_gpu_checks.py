"""An engine sized in bytes (``engine.kv_cache_gib``) starts, and restarts, beside a trainer holding most of the GPU.

    python tests/workers/engine_restart_gpu_checks.py MODEL_DIR HELD

The trainer's memory is stood for by one tensor of ``HELD`` × the GPU's memory, allocated before the engine
starts (a colocated run builds its trainer first). vLLM 0.32 checks at every start that ``gpu_memory_utilization``
× the GPU is free, whatever sizes the KV cache (``engines.vllm_engine.kv_cache_args``). Greedy completions before
and after the restart (world 1: a fresh ``LLM``). Prints what was checked.
"""

from __future__ import annotations

import json
import sys

import torch


def main(model_dir: str, held: float) -> None:
    from megarl.distributed.parallel import init_process_group
    from megarl.engines.vllm_engine import VLLMEngine
    from megarl.types import GenerationRequest

    init_process_group()
    torch.cuda.set_device(0)
    trainer = torch.empty(int(torch.cuda.mem_get_info()[1] * held), dtype=torch.uint8, device="cuda")
    free_at_start = torch.cuda.mem_get_info()[0] / torch.cuda.mem_get_info()[1]
    engine = VLLMEngine(model_dir, max_model_len=64, kv_cache_gib=0.25, seed=0, dtype="bfloat16")
    requests = [GenerationRequest(prompt_ids=[5, 6, 7, 8], max_tokens=8, greedy=True)]
    before = engine.generate(requests, seed=0)[0][0].token_ids
    engine.restart()
    after = engine.generate(requests, seed=0)[0][0].token_ids
    print(json.dumps({"free_at_start": free_at_start, "share": engine._args["gpu_memory_utilization"],
                      "kv_bytes": engine._args["kv_cache_memory_bytes"], "same": before == after,
                      "tokens": len(after), "trainer_bytes": trainer.numel()}))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
