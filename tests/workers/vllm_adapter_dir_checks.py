"""A LoRA run's exported adapter directory (``run_dir/hf/step_N``) served by vLLM from its files: a CPU engine over
the base with LoRA on, the directory as a ``LoRARequest`` (vLLM reads ``adapter_config.json`` and
``adapter_model.safetensors`` itself), the trainer's batch as prompts; the logprob vLLM gives each token against the
trainer's (``lora_export_checks.py``'s ``trainer.pt``), where the loss mask counts it.

    python tests/workers/vllm_adapter_dir_checks.py BASE_DIR ADAPTER_DIR TRAINER_PT

Routed experts' adapters in PEFT's fused layout (``target_parameters``) take vLLM's ``enable_mixed_moe_lora_format``
on the engine and ``is_3d_lora_weight`` on the request. Prints one JSON line: the largest gap with the adapter and
without it (the base: the adapter acts).
"""

from __future__ import annotations

import json
import sys

import torch


def main(base: str, adapter: str, trainer_pt: str) -> None:
    from megarl.engines.vllm_engine import set_cpu_engine_env

    set_cpu_engine_env(0.25)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from megarl.compat.vllm import lora_patches
    from megarl.engines.adapters import lora_args

    cfg = json.loads(open(f"{adapter}/adapter_config.json").read())
    got = torch.load(trainer_pt)
    lora_patches()
    fused = bool(cfg.get("target_parameters"))  # routed experts in PEFT's fused layout: vLLM's flags for it
    modules = (*cfg["target_modules"], *(("experts",) if fused else ()))
    llm = LLM(model=base, dtype="float32", enforce_eager=True, max_model_len=64, seed=0,
              **lora_args(cfg["r"], modules), **({"enable_mixed_moe_lora_format": True} if fused else {}))
    rows = []
    for ids, labels, mask in zip(got["input_ids"], got["labels"], got["loss_mask"]):
        length = int((labels != 0).nonzero().max()) + 1  # (build_batch pads with 0 after the row)
        rows.append((ids[:length].tolist() + [int(labels[length - 1])], mask[:length].bool()))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)

    def gaps(request) -> float:
        outs = llm.generate([TokensPrompt(prompt_token_ids=toks) for toks, _ in rows], params, lora_request=request,
                            use_tqdm=False)
        worst = 0.0
        for i, ((toks, mask), out) in enumerate(zip(rows, outs)):
            theirs = torch.tensor([out.prompt_logprobs[j][toks[j]].logprob for j in range(1, len(toks))])
            mine = got["logprobs"][i, : len(toks) - 1]
            worst = max(worst, float((theirs - mine)[mask].abs().max()))
        return worst

    request = LoRARequest("exported", 1, adapter, **({"is_3d_lora_weight": True} if fused else {}))
    print(json.dumps({"gap": gaps(request), "gap_base": gaps(None)}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
