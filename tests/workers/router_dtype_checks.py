"""The dtype MoE routers compute their scores in, under a trainer of ``LAYOUT`` (tests/helpers/trainers.py).

    python tests/workers/router_dtype_checks.py MODEL_DIR LAYOUT

One logprob pass; prints the dtypes of the routers' inputs and of their logits (megatron-core's ``gating``).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers.trainers import build_trainer, fixed_batch  # noqa: E402


def main(model_dir: str, layout: str) -> None:
    from megatron.core.transformer.moe.router import TopKRouter

    from megarl.config.schema import OptimConfig

    _, cfg, trainer = build_trainer(layout, model_dir, OptimConfig(lr=0.0, micro_batch_size=4))
    seen: list[tuple[str, str]] = []
    for chunk in trainer.chunks:
        for m in chunk.modules():
            if isinstance(m, TopKRouter):
                def gating(x, _m=m, _gating=m.gating):
                    logits = _gating(x)
                    seen.append((str(x.dtype), str(logits.dtype)))
                    return logits
                m.gating = gating
    trainer.logprobs(fixed_batch(cfg["vocab_size"]))
    print(json.dumps({"inputs": sorted({i for i, _ in seen}), "logits": sorted({o for _, o in seen}),
                      "calls": len(seen)}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
    from helpers.processes import end_process_group  # (tests/ is on the worker's path)
    end_process_group()  # gloo ended before the interpreter's teardown
