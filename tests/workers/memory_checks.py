"""GPU only: vLLM sleep mode and trainer offload free device memory and give equal results afterwards.

    python tests/workers/memory_checks.py WORKDIR 1|2      # engine sleep level 1 or 2
    python tests/workers/memory_checks.py WORKDIR offload  # trainer optimizer state + grads to host and back

Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers


def free_bytes() -> int:
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def sleep_checks(workdir: str, level: int) -> None:
    import torch
    from safetensors.torch import load_file

    from megarl.distributed.parallel import init_process_group
    from megarl.engines.memory import EngineSleep
    from megarl.engines.vllm_engine import VLLMEngine
    from megarl.models.tiny import TinyShape, make_tiny_model
    from megarl.types import GenerationRequest

    model = make_tiny_model(os.path.join(workdir, "model"), TinyShape(family="qwen2"), seed=0)
    init_process_group()
    engine = VLLMEngine(str(model), max_model_len=64, kv_cache_gib=0.25, seed=0, max_num_seqs=8, enable_sleep_mode=True)
    prompts = [GenerationRequest([3, 5, 7, 11, 13], n=1, max_tokens=8, greedy=True)]
    before = engine.generate(prompts, seed=0)[0][0]
    weights = load_file(os.path.join(str(model), "model.safetensors"))
    weights_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    sleep = EngineSleep(engine, level, log=print)
    awake = free_bytes()
    sleep.sleep()
    asleep = free_bytes()
    sleep.wake()
    if level == 2:  # level 2 dropped the weights: the sync brings them back
        engine.load(((n, t.to("cuda")) for n, t in weights.items()), version=0)
    after = engine.generate(prompts, seed=0)[0][0]
    torch.cuda.synchronize()
    print(json.dumps({"freed_bytes": asleep - awake, "weights_bytes": weights_bytes,
                      "same_tokens": before.token_ids == after.token_ids,
                      "max_logprob_diff": max(abs(a - b) for a, b in zip(before.logprobs, after.logprobs))}),
          flush=True)


def offload_checks(workdir: str) -> None:
    import torch

    from helpers.trainers import build_trainer, fixed_batch
    from megarl.algo.losses import ppo_clip_loss
    from megarl.config.schema import OptimConfig
    from megarl.engines.memory import TrainerOffload
    from megarl.models.tiny import TinyShape, make_tiny_model

    model = str(make_tiny_model(os.path.join(workdir, "model"), TinyShape(family="qwen2"), seed=0))

    def losses(offload: bool) -> tuple[list[float], int]:
        from megatron.core import parallel_state as mpu

        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        _, cfg, trainer = build_trainer("single", model, OptimConfig(lr=3e-3, micro_batch_size=4))
        batch = fixed_batch(cfg["vocab_size"])
        off = TrainerOffload(trainer, offload, log=print)
        out, freed = [], 0
        for _ in range(3):
            out.append(trainer.train_step(batch, lambda lp, mb: ppo_clip_loss(
                lp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"], 0.2, 0.28))["loss"])
            before = torch.cuda.memory_allocated()
            off.offload()
            freed = max(freed, before - torch.cuda.memory_allocated())
            off.restore()
        return out, freed

    plain, _ = losses(False)
    offloaded, freed = losses(True)
    # a frozen model (the KL reference): its weights leave the device and come back to the same logprobs
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    _, cfg, frozen = build_trainer("single", model, OptimConfig(micro_batch_size=4), trainable=False)
    batch = fixed_batch(cfg["vocab_size"])
    before, off = frozen.logprobs(batch), TrainerOffload(frozen, True, log=print)
    held = torch.cuda.memory_allocated()
    off.offload()
    reference_freed = held - torch.cuda.memory_allocated()
    off.restore()
    print(json.dumps({"freed_bytes": freed, "losses_equal": plain == offloaded, "reference_freed": reference_freed,
                      "reference_equal": bool(torch.equal(before, frozen.logprobs(batch)))}), flush=True)


if __name__ == "__main__":
    workdir, what = sys.argv[1:]
    if what == "offload":
        offload_checks(workdir)
    else:
        sleep_checks(workdir, int(what))
