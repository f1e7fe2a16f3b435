"""Routed experts' adapters into vLLM's fused-MoE LoRA layer, on real parts: a megatron-core trainer with adapters on
attention and every expert (gloo) → an in-process vLLM CPU engine started with LoRA on its ``experts`` modules.

    python tests/workers/lora_expert_engine_checks.py MOE_MODEL_DIR

vLLM serves expert LoRA through its Triton kernel only, which has no CPU build: the engine starts and takes the
adapter (what the sync does), and what it would compute with is read from the layer itself — after the adapter is
activated, every expert's slot of the layer's stacked tensors (gate and up A and B, down A and B; B as vLLM keeps
it, scaled by alpha / r) against the trainer's adapters. A generation is then tried and its error kept (what the
CPU refusal stands on). An adapter missing one expert is refused by the load, the engine serving what it did.
Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from workers.lora_sync_checks import lora_trainer  # noqa: E402


def main(model_dir: str) -> None:
    from megarl.engines.vllm_engine import VLLMEngine, set_cpu_engine_env

    set_cpu_engine_env(0.25)
    import vllm  # noqa: F401  (before the CPU adapter patches torch.cuda)

    from megarl.config.schema import LoraConfig
    from megarl.config.validate.lora import hf_modules
    from megarl.distributed.parallel import init_process_group
    from megarl.trainer.lora_peft import gather_adapters
    from megarl.types import GenerationRequest
    from megarl.weight_sync.adapters import AdapterStream
    from megarl.weight_sync.load import WeightLoadError

    init_process_group()
    lora = LoraConfig(rank=4, alpha=8.0, targets="linear_qkv,linear_proj,experts")
    engine = VLLMEngine(model_dir, max_model_len=64, kv_cache_gib=0.25, seed=0, max_num_seqs=8, lora_rank=4,
                        lora_modules=hf_modules(lora))
    ps, cfg, trainer, step = lora_trainer("single", model_dir, lora)
    step()  # B off zero
    stream = AdapterStream.of(trainer, engine.dtype)
    tensors = stream.tensors()
    out: dict = {"tensors": len(tensors)}
    broken = {k: v for k, v in tensors.items() if ".layers.1.mlp.experts.2." not in k}
    try:
        engine.load_adapter(broken, stream.config, 1)
    except WeightLoadError as exc:
        out["broken"] = str(exc)
    out["served_after_broken"] = engine.lora_request is not None
    engine.load_adapter(tensors, stream.config, 1)
    manager = engine.worker.model_runner.lora_manager._adapter_manager
    adapter_id = engine.lora_request.lora_int_id
    manager.activate_adapter(adapter_id)
    slot = manager.lora_index_to_id.index(adapter_id)
    whole = gather_adapters(trainer.modules, ps, cfg)
    scale, f = lora.alpha / lora.rank, cfg["moe_intermediate_size"]
    gaps, experts = [], 0
    for name, (a, b) in whole.items():
        if ".mlp.experts.local_experts." not in name:
            continue
        layer, expert = int(name.split(".")[2]), int(name.split(".")[6])
        m = manager.modules[f"model.layers.{layer}.mlp.experts"]
        if name.endswith("linear_fc1"):
            served = [(m.w13_lora_a_stacked[0], a), (m.w13_lora_a_stacked[1], a),
                      (m.w13_lora_b_stacked[0], b[:f]), (m.w13_lora_b_stacked[1], b[f:])]
        else:
            served = [(m.w2_lora_a_stacked[0], a), (m.w2_lora_b_stacked[0], b)]
        for stacked, ours in served:  # vLLM pads the rank to its max_lora_rank (A's rows, B's columns: zeros)
            got, r = stacked[slot, expert].float(), lora.rank
            got, pad = (got[:r], got[r:]) if ours is a else (got[:, :r], got[:, r:])
            want = ours.float() if ours is a else scale * ours.float()  # (vLLM keeps B scaled by alpha / r)
            gaps.append(max(float((got - want).abs().max()), float(pad.abs().max())))
        experts += 1
    out.update(expert_linears=experts, max_gap=max(gaps), b_moved=float(max(b.abs().max() for _, b in whole.values())))
    try:
        engine.generate([GenerationRequest(prompt_ids=[5, 6, 7], max_tokens=2)], seed=0)
        out["generate"] = "ok"
    except Exception as exc:  # noqa: BLE001  (recorded: the test reads why)
        out["generate"] = f"{type(exc).__name__}: {exc}"[:400]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
