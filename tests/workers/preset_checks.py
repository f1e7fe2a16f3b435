"""Every algorithm preset for a few RL steps in the real loop (megatron-core + vLLM CPU, tiny MoE).

Prints one JSON line: per preset, the metrics of each step and whether the policy's
weights moved. Usage: python tests/workers/preset_checks.py WORKDIR [PRESET ...] (default: every preset)
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from helpers.trainers import hf_weights
from megarl.config import load_config
from megarl.config.presets import PRESETS
from megarl.convert.export import export_hf
from megarl.session import build_controller, build_learners, build_session
from megarl.train import rl_step
from megarl.trainer.sft import supervised_warmup, task_examples
from megarl.weight_sync.protocol import WeightSync


def snapshot(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.modules[0].named_parameters()}


def main(workdir: str, *presets: str) -> None:
    work = Path(workdir)
    base = [f"model.path={work / 'model'}", "model.make_tiny=qwen3_moe", f"train.run_dir={work / 'run'}",
            "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=24",
            "engine.max_model_len=96", "optim.micro_batch_size=16", "data.eval_size=4", "optim.lr=1e-3",
            "data.max_digits=1", "trainer.precision=fp32"]  # (fp32: the same weights give a tiny logprob gap)
    s = build_session(load_config(None, base))
    # A short supervised warm-up so that rewards vary within groups (a random policy scores 0 everywhere
    # and every advantage would be 0); the presets then start from this checkpoint.
    supervised_warmup(s.trainer, s.tokenizer, task_examples(s.task, s.tokenizer), 60, 64, 3e-3, log=lambda *a: None)
    export_hf(s.trainer, work / "model", work / "warm")
    base = [b for b in base if not b.startswith(("model.path", "model.make_tiny"))] + [f"model.path={work / 'warm'}"]
    engines, source, score = s.controller.engines, s.controller.next_prompt, s.controller.score
    out = {}
    for preset in presets or PRESETS:
        extra = ["algo.minibatches=2", "algo.ppo_epochs=2"] if preset == "ppo" else []
        extra += ["algo.tis=token", "algo.entropy_coef=0.001"] if preset == "grpo" else []
        extra += (["algo.dual_clip=3.0", "algo.prioritized_replay=true", "algo.minibatches=2"]
                  if preset == "rloo" else [])
        extra += ["data.pool_size=8", "algo.curriculum=true"] if preset == "dr_grpo" else []
        extra += ["algo.tis=mask_token"] if preset == "cispo" else []  # CISPO's weight times IcePop's mask
        cfg = load_config(None, base + [f"algo.preset={preset}"] + extra)
        s.cfg = cfg
        s.learners = build_learners(cfg, s.hf_cfg, s.ps)
        s.trainer = s.learners.policy
        s.weight_sync = WeightSync(s.trainer, s.engines.dtype, cfg.sync.bucket_mib, cfg.sync.check_every)
        s.engines.engine.update_weights(hf_weights(s.trainer))
        s.controller = build_controller(cfg, engines, source, score)
        before = snapshot(s.trainer)
        steps, versions = [], []
        for step in range(3):
            steps.append(rl_step(s, step))
            versions.append(s.policy_version)
        after = snapshot(s.trainer)
        moved = max(float((after[n] - before[n]).abs().max()) for n in before)
        out[preset] = {
            "steps": steps,
            "moved": moved,
            "versions": versions,
            "finite": all(math.isfinite(v) for m in steps for v in m.values()),
            "cfg": {k: getattr(cfg.algo, k) for k in ("advantage", "policy_loss", "loss_agg", "critic_warmup_steps")},
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
