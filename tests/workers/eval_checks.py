"""Writes a run checkpoint for ``megarl eval`` to read (run in a subprocess by test_math_example.py).

Builds the session of a config, moves the policy's weights away from the HF model's
(seeded noise), records the greedy responses of the first held-out prompts with the
moved weights synced into the engine (and with the original ones), and saves the
trainer as a megatron dist checkpoint in the run-checkpoint layout:
``RUN/checkpoints/step_2/policy`` plus ``RUN/checkpoints/latest`` naming ``step_2``.
"""

import json
import sys

import torch

from helpers.trainers import hf_weights
from megarl.checkpoint.dist import save_checkpoint
from megarl.config import load_config
from megarl.session import build_session
from megarl.types import GenerationRequest


def greedy(s, n=3):
    outs = s.engines.generate([GenerationRequest(p.ids, max_tokens=s.cfg.rollout.max_new_tokens, greedy=True)
                              for p in s.eval_prompts[:n]], seed=0)
    return [s.tokenizer.decode(o[0].token_ids, skip_special_tokens=True) for o in outs]


def main(config: str, run_dir: str, *overrides: str) -> None:
    cfg = load_config(config, [*overrides, f"train.run_dir={run_dir}/writer"])
    s = build_session(cfg)
    base = greedy(s)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in s.trainer.modules:
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.5 * p.float().std().clamp(min=0.02))
    s.engines.engine.update_weights(hf_weights(s.trainer))
    moved = greedy(s)
    save_checkpoint(s.trainer, f"{run_dir}/checkpoints/step_2/policy")
    with open(f"{run_dir}/checkpoints/latest", "w") as f:
        f.write("step_2\n")
    s.rewards.close()
    print(json.dumps({"base": base, "moved": moved}))


if __name__ == "__main__":
    main(*sys.argv[1:])
