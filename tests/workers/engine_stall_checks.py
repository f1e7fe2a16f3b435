"""Real vLLM (CPU): a generation that raised leaves nothing behind, and a restart keeps torch's default group.

    python tests/workers/engine_stall_checks.py WORKDIR

A spin a new user met: a model with head size 16 (vLLM's CPU attention cannot run it) fails every
generation; its batch of 16 requests stayed in vLLM's scheduler holding all 8 slots, so the next phase's requests
waited behind it while every engine step scheduled nothing (no token, no error). Here the failed generation's
requests are gone, so the phase's first step raises the real error (before the fix: the controller's no-progress
guard, EngineStalled). Then the engine is restarted in one process (onto a model it can run) with the failed
engine still referenced by the error, as the keeper holds it, twice: after that failure and after the
max_model_len failure (a prompt vLLM refuses before any step). Dropping the old engine used to run vLLM's
teardown, which destroys torch's default process group (the trainer's): measured, after the second restart
``dist.is_initialized()`` was False and the keeper's next log line crashed. Prints one JSON line.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path


def main(workdir: str) -> None:
    import torch.distributed as dist

    from megarl.distributed.parallel import init_process_group
    from megarl.engines.vllm_engine import VLLMEngine, VLLMSlotEngine
    from megarl.models.tiny import TinyShape, make_tiny_model
    from megarl.rollout.controller import ControllerConfig, PromptItem, RolloutController
    from megarl.types import GenerationRequest

    work = Path(workdir)
    bad = make_tiny_model(work / "hd16", TinyShape(family="qwen2", hidden_size=64, num_layers=2))
    good = make_tiny_model(work / "hd32", TinyShape(family="qwen2", hidden_size=64, num_heads=2, num_kv_heads=2,
                                                    num_layers=2))
    init_process_group()  # world 1, as the trainer has it
    engine = VLLMEngine(str(bad), max_model_len=64, kv_cache_gib=0.25, max_num_seqs=8)
    record = {}
    error = None
    try:
        engine.generate([GenerationRequest([5, 6, 7, 8], n=1, max_tokens=4, greedy=True) for _ in range(16)], seed=0)
    except Exception as exc:  # noqa: BLE001  (what the test asserts)
        error = exc
        record["generate_error"] = f"{type(exc).__name__}: {exc}"
    core = engine.llm.llm_engine
    record["held_after_failed_generate"] = (len(core.output_processor.request_states)
                                            + core.engine_core.engine_core.scheduler.get_num_unfinished_requests())
    counter = iter(range(10**6))
    ctrl = RolloutController(ControllerConfig(mode="partial", group_size=2, update_groups=2, rollout_groups=4,
                                              max_tokens=4), [VLLMSlotEngine(engine, 8)],
                             lambda: PromptItem(next(counter), [5, 6, 7, 8], key=0))
    try:
        ctrl.run_phase(0)
        record["phase_error"] = ""
    except Exception as exc:  # noqa: BLE001
        record["phase_error"] = f"{type(exc).__name__}: {exc}"
    engine._args["model"] = str(good)  # the restart brings up a model it can run
    engine.restart()
    del error
    gc.collect()  # the failed engine's last reference gone: its teardown must not take the default group
    record["rank_after_restart"] = dist.get_rank() if dist.is_initialized() else None
    outs = engine.generate([GenerationRequest([5, 6, 7, 8], n=1, max_tokens=4, greedy=True) for _ in range(4)], seed=0)
    record["restart_generates"] = sum(len(cs) for cs in outs)
    try:  # max_model_len=8: vLLM refuses the prompt before any step (VLLMValidationError)
        engine.generate([GenerationRequest(list(range(5, 85)), n=1, max_tokens=4, greedy=True)], seed=0)
    except Exception as exc:  # noqa: BLE001
        error = exc
        record["long_prompt_error"] = type(exc).__name__
    engine.restart()
    del error
    gc.collect()
    record["rank_after_second_restart"] = dist.get_rank() if dist.is_initialized() else None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from megarl.compat.vllm import cpu_attention_head_sizes

    record["head_sizes_read"] = list(cpu_attention_head_sizes())
    record["head_sizes_asked"] = list(CPUAttentionBackend.get_supported_head_sizes())
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
