"""The update-batch contract in the real training loop: tiny Qwen2, real vLLM CPU engine, real trainer.

For each rollout mode, a few ``rl_step`` calls on one session (the controller is
rebuilt per mode, the engine and trainer are shared). Few slots and an
oversubscribed, length-capped rollout make groups finish together, so the bound
is exercised. Prints one JSON line: per mode, ``rollout/groups_released`` of each
step and the scalars written to TensorBoard.

Usage: python tests/workers/rollout_loop_checks.py WORKDIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megarl.config import load_config
from megarl.session import build_controller, build_session
from megarl.train import rl_step

KEYS = ("rollout/groups_released", "rollout/groups_over_bound", "rollout/bubble_ratio", "rollout/staleness_max",
        "rollout/wait_phases_max")


def main(workdir: str) -> None:
    work = Path(workdir)
    cfg = load_config(None, [
        f"model.path={work / 'model'}", "model.make_tiny=qwen2", f"train.run_dir={work / 'run'}",
        "rollout.prompts_per_step=3", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=16",
        "rollout.oversubscription=3", "rollout.staleness_limit=2", "engine.slots=8", "engine.kv_cache_gib=0.25",
        "engine.max_model_len=64", "optim.micro_batch_size=6", "data.eval_size=4", "train.steps=1",
    ])
    s = build_session(cfg)
    out = {}
    step = 0
    for mode in ("sync", "on_policy", "partial"):
        s.cfg.rollout.mode = mode
        s.controller = build_controller(s.cfg, s.controller.engines, s.controller.next_prompt, s.controller.score)
        out[mode] = []
        for _ in range(3):
            metrics = rl_step(s, step)
            step += 1
            s.logger.scalars(step, metrics)
            out[mode].append({k: metrics[k] for k in KEYS})
    # every group filtered up to the oversampling cap (a verifier that always fails): no update, so the policy
    # version stays and the next on-policy phase samples tokens of the version it trains (staleness 0, not 1)
    s.cfg.rollout.mode = "on_policy"
    s.controller = build_controller(s.cfg, s.controller.engines, s.controller.next_prompt, s.controller.score)
    versions = [s.policy_version]
    keep, s.controller.keep_group, s.controller.cfg.release_cap = s.controller.keep_group, (lambda g: False), 3
    skipped = rl_step(s, step)
    versions.append(s.policy_version)
    s.controller.keep_group, s.controller.cfg.release_cap = keep, 0
    s.tokenizer.pad_token = None  # as Llama-3's and Mistral's tokenizers: the update pads with another id
    after = rl_step(s, step + 1)
    versions.append(s.policy_version)
    out["skip"] = {"versions": versions, "engine_version": s.engines.engine.weight_version,
                   "skipped_released": skipped["rollout/groups_released"], "after": {k: after[k] for k in KEYS}}
    s.logger.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(cfg.train.run_dir) / "tb"))
    acc.Reload()
    out["tb_groups_released"] = [e.value for e in acc.Scalars("rollout/groups_released")]
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
