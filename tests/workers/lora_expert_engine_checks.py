"""Routed experts' adapters served by a vLLM CPU engine, on real parts: a megatron-core trainer with adapters on
attention and every expert (gloo) → an in-process vLLM CPU engine started with LoRA on its ``experts`` modules (its
fused-MoE layer's LoRA path on CPU: ``compat.vllm_moe_lora``).

    python tests/workers/lora_expert_engine_checks.py MOE_MODEL_DIR

1. The trainer takes a step (every B moves off zero); the engine still serves the base: the audit's gap is large.
2. A sync whose adapters miss one expert fails: version unchanged, the failure counted and said.
3. The sync then succeeds: version 1, engine ≈ trainer (the audit). What the engine computes with, read from the
   layer itself: every expert's slot of vLLM's stacked tensors (gate and up A and B, down A and B; B as vLLM keeps
   it, scaled by alpha / r) against the trainer's adapters.
4. The experts' adapters are what the engine serves: with them zeroed in the trainer alone the audit's gap is
   large again.
Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from workers.lora_sync_checks import lora_trainer  # noqa: E402

EXPERT = ".mlp.experts.local_experts."


def main(model_dir: str) -> None:
    from megarl.engines.vllm_engine import VLLMEngine, set_cpu_engine_env

    set_cpu_engine_env(0.25)
    import vllm  # noqa: F401  (before the CPU adapter patches torch.cuda)

    from megarl.config.schema import LoraConfig
    from megarl.config.validate.lora import hf_modules
    from megarl.distributed.parallel import init_process_group
    from megarl.engines.colocated import ColocatedEngines
    from megarl.weight_sync.adapters import AdapterStream
    from megarl.weight_sync.protocol import WeightSync, logprob_gap

    init_process_group()
    lora = LoraConfig(rank=4, alpha=8.0, targets="linear_qkv,linear_proj,experts")
    engine = VLLMEngine(model_dir, max_model_len=64, kv_cache_gib=0.25, seed=0, max_num_seqs=8, lora_rank=4,
                        lora_modules=hf_modules(lora))
    ps, cfg, trainer, step = lora_trainer("single", model_dir, lora)
    lines: list[str] = []
    engines = ColocatedEngines(engine, 8, 1)
    proto = WeightSync(trainer, engines.dtype, bucket_mib=1, check_every=1, say=lines.append)
    step()  # every B off zero
    out: dict = {"gap_base": logprob_gap(engines, trainer, seed=3)}

    class MissingAnExpert(AdapterStream):
        def tensors(self):
            return {k: v for k, v in super().tensors().items() if ".layers.1.mlp.experts.2." not in k}

    out["failed"] = proto.run(engines, 1, stream=MissingAnExpert.of(trainer, engines.dtype)).metrics()
    out["ok"] = proto.run(engines, 1).metrics()
    out["log"] = lines
    out["tensors"] = len(AdapterStream.of(trainer, engines.dtype).tensors())
    out.update(served_as_trained(engine, trainer, ps, cfg, lora))
    with torch.no_grad():  # the trainer without its experts' adapters: the engine's differ
        for name, module in trainer.modules[0].named_modules():
            if EXPERT[1:] in name and hasattr(module, "lora"):
                module.lora.b.zero_()
    out["gap_without_experts"] = logprob_gap(engines, trainer, seed=3)
    print(json.dumps(out), flush=True)


def served_as_trained(engine, trainer, ps, cfg, lora) -> dict:
    """The largest gap of any expert's A or B in the engine's activated slot to the trainer's (0 when right)."""
    from megarl.trainer.lora_peft import gather_adapters

    manager = engine.worker.model_runner.lora_manager._adapter_manager
    adapter_id = engine.lora_request.lora_int_id
    manager.activate_adapter(adapter_id)
    slot = manager.lora_index_to_id.index(adapter_id)
    scale, f, gaps = lora.alpha / lora.rank, cfg["moe_intermediate_size"], []
    experts = {k: v for k, v in gather_adapters(trainer.modules, ps, cfg).items() if EXPERT in k}
    for name, (a, b) in experts.items():
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
    return {"expert_linears": len(experts), "slot_gap": max(gaps),
            "b_moved": float(max(b.abs().max() for _, b in experts.values()))}


if __name__ == "__main__":
    main(*sys.argv[1:])
