"""A few optimizer steps of the megatron-core trainer in one precision at one layout (gloo, CPU), for comparison
with fp32 in one process. Launched by the tests with torchrun (2 processes) or plainly (1).

    python tests/workers/precision_checks.py LAYOUT MODEL_DIR OUT_DIR STEPS

The last pipeline stage of data-parallel rank 0 writes OUT_DIR/result.json: each step's loss and grad norm, the
batch's logprobs after the steps, and the dtypes the model's weights and the optimizer's parameters (its main
params: what Adam updates) are in on this rank.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers.processes import end_process_group  # noqa: E402
from helpers.trainers import build_trainer, fixed_batch  # noqa: E402


def main(layout: str, model_dir: str, out_dir: str, steps: str) -> None:
    from megarl.algo.losses import ppo_clip_loss
    from megarl.config.schema import OptimConfig

    ps, cfg, trainer = build_trainer(layout, model_dir, OptimConfig(lr=1e-3, micro_batch_size=2, grad_clip=1.0))
    batch = fixed_batch(cfg["vocab_size"])
    history = []
    for _ in range(int(steps)):
        m = trainer.train_step(batch, lambda lp, mb: ppo_clip_loss(lp, mb["old_logprobs"], mb["advantages"],
                                                                    mb["loss_mask"], 0.2, 0.28))
        history.append({"loss": m["loss"], "grad_norm": m["grad_norm"], "skipped": m["skipped"]})
    logp = trainer.logprobs(batch)
    chain = getattr(trainer.optimizer, "chained_optimizers", None) or [trainer.optimizer]
    main_dtypes = sorted({str(p.dtype) for o in chain for g in o.optimizer.param_groups for p in g["params"]})
    model_dtypes = sorted({str(p.dtype) for m in trainer.modules for p in m.parameters()})
    grad_dtypes = sorted({str(b.grad_data.dtype)
                          for c in trainer.chunks for b in c.buffers + c.expert_parallel_buffers})
    os.makedirs(out_dir, exist_ok=True)
    if ps.is_last_stage and ps.dp_rank == 0 and ps.tp_rank == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({"layout": layout, "steps": history, "logprobs": logp.tolist(), "mask": batch.loss_mask.tolist(),
                       "main_dtypes": main_dtypes, "model_dtypes": model_dtypes, "grad_dtypes": grad_dtypes,
                       "optimizers": sorted({type(o).__name__ for o in chain})}, f)
    end_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps({"ok": True}), flush=True)
