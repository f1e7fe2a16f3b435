"""A LoRA trainer's export at one layout (gloo, CPU, fp32): its adapters as a PEFT adapter directory, for the test
to load with ``peft`` over the base. Launched by the tests with torchrun (2 processes) or plainly (1).

    python tests/workers/lora_export_checks.py LAYOUT MODEL_DIR OUT_DIR [TARGETS]

Every B is drawn at random (seeded by its layer's global name, drawn whole and sliced as the layer is split, so the
adapters are one process's at any layout) so that the adapters act; then the export runs as a run's does
(``export_policy`` at step 1 of a run whose ``train.export_hf_every`` is 1, run dir OUT_DIR; and ``export_hf`` to
OUT_DIR/direct). Rank 0 writes
OUT_DIR/trainer.pt: the batch's input ids, labels and loss mask and the trainer's logprobs of it, and the logprobs
with the adapters off (the base: the gap between the two says the adapters act).
"""

from __future__ import annotations

import json
import os
import sys
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers.processes import end_process_group  # noqa: E402
from helpers.trainers import LAYOUTS, fixed_batch, seeded_layout  # noqa: E402

RANK, ALPHA = 4, 8.0


def random_b(weight: str, adapter) -> torch.Tensor:
    """This rank's part of a B drawn whole from a generator seeded by its base weight's global name."""
    rows = adapter.b.shape[0] * (1 if adapter.row else adapter.tp)
    whole = torch.randn(rows, RANK, generator=torch.Generator().manual_seed(zlib.crc32(weight.encode()))) * 0.05
    if adapter.row or adapter.tp == 1:  # (a row-parallel layer's B is replicated)
        return whole
    r, n = adapter.tp_rank, adapter.tp
    if weight.endswith("linear_fc1.weight"):  # gate and up, each split over TP (megatron's fused fc1)
        gate, up = whole.chunk(2)
        return torch.cat([gate.chunk(n)[r], up.chunk(n)[r]])
    return whole.chunk(n)[r]


def main(layout: str, model_dir: str, out_dir: str, targets: str = "") -> None:
    from types import SimpleNamespace

    from megarl.config.schema import LoraConfig, OptimConfig, RunConfig
    from megarl.convert.export import export_hf, export_policy
    from megarl.models.hf_config import num_experts
    from megarl.models.sharding import global_name
    from megarl.trainer.lora import adapters_off
    from megarl.trainer.policy import PolicyTrainer

    spec = dict(LAYOUTS[layout])
    dispatcher = spec.pop("moe_dispatcher", "alltoall")
    ps, cfg = seeded_layout(spec, model_dir)
    optim = OptimConfig(lr=1e-3, micro_batch_size=2, grad_clip=0.0, logprob_chunk=8)
    lora = LoraConfig(rank=RANK, alpha=ALPHA, **({"targets": targets} if targets else {}))
    trainer = PolicyTrainer(cfg, model_dir, ps, optim, lora=lora, packing=True, moe_dispatcher=dispatcher)
    with torch.no_grad():
        for vp, module in enumerate(trainer.modules):
            for name, sub in module.named_modules():
                if hasattr(sub, "lora"):
                    weight = global_name(f"{name}.weight", cfg["num_hidden_layers"], num_experts(cfg), ps.coords(vp))
                    sub.lora.b.copy_(random_b(weight, sub.lora))
    batch = fixed_batch(cfg["vocab_size"])
    logprobs = trainer.logprobs(batch)
    with adapters_off(trainer.modules):
        base = trainer.logprobs(batch)
    run = RunConfig()
    run.model.path, run.lora, run.train.export_hf_every = model_dir, lora, 1
    exported = export_policy(SimpleNamespace(cfg=run, trainer=trainer, run_dir=out_dir), 1)
    export_hf(trainer, model_dir, os.path.join(out_dir, "direct"))  # (export_hf on a LoRA trainer)
    if ps.rank == 0:
        assert exported is not None and exported.name == "step_1", exported
        torch.save({"input_ids": batch.input_ids, "labels": batch.labels, "loss_mask": batch.loss_mask,
                    "logprobs": logprobs, "base": base}, os.path.join(out_dir, "trainer.pt"))
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps({"ok": True}), flush=True)
