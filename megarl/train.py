"""The RL loop in one page: generate → reward → advantage → train → sync → log.

Run it with ``megarl train --config FILE [key=value ...]`` (or ``--nproc N`` for
torchrun). Every step calls into a room and nothing else:

- generate + reward: the SortedRL controller runs one phase on the engines and
  scores each group as it is released (``megarl/rollout``);
- advantage + train: ``rl_update`` builds the batch, the advantages of the chosen
  algorithm and takes the optimizer steps (``megarl/trainer/rl_update.py``);
- sync: the trainer's weights go into the engine in memory (``megarl/weight_sync``).
"""

from __future__ import annotations

import sys
import time

import torch

from megarl.checkpoint.hf_export import export_policy
from megarl.config import RunConfig
from megarl.rollout.evaluate import greedy_pass_at_1
from megarl.runtime import Session, build_session
from megarl.trainer.lr_schedule import lr_at
from megarl.trainer.rl_update import rl_update
from megarl.trainer.sft import supervised_warmup

CONSOLE_KEYS = ("reward/mean", "response/len_mean", "loss/policy", "rollout/bubble_ratio", "timing/gen_s",
                "timing/train_s", "eval/pass_at_1")


def evaluate(s: Session) -> float:
    return greedy_pass_at_1(s.engine, s.tokenizer, s.task.eval_problems, s.cfg.rollout.max_new_tokens, s.rewards)


def rl_step(s: Session, step: int) -> dict[str, float]:
    cfg, t0 = s.cfg, time.time()
    torch.manual_seed(cfg.train.seed * 100003 + step)  # every rank samples alike (engine TP)
    groups, phase = s.controller.run_phase(version=step)  # generate, reward (at release)
    t1 = time.time()
    if not groups:  # e.g. dynamic sampling found no informative group within its cap: nothing to learn
        print(f"step {step}: no useful group released ({phase.groups_filtered} filtered); update skipped", flush=True)
        return {"timing/gen_s": t1 - t0, "loss/policy": 0.0, **phase.summary()}
    metrics = rl_update(s.learners, groups, cfg, s.tokenizer.pad_token_id, step)  # advantage, train
    t2 = time.time()
    s.engine.update_weights(s.trainer.hf_weights())  # sync
    t3 = time.time()
    s.logger.histogram(step + 1, "rollout/staleness", phase.staleness)  # versions behind, per trained token
    rewards = [x.reward for g in groups for x in g.samples]
    lengths = [len(x.response_ids) for g in groups for x in g.samples]
    return {
        "reward/mean": sum(rewards) / len(rewards),
        "reward/pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards),
        "reward/errors": float(s.rewards.errors + s.rewards.timeouts),
        "response/len_mean": sum(lengths) / len(lengths),
        "response/len_max": max(lengths),
        "timing/gen_s": t1 - t0,
        "timing/train_s": t2 - t1,
        "timing/sync_s": t3 - t2,
        **metrics,
        **phase.summary(),
    }


def run(cfg: RunConfig) -> dict:
    s = build_session(cfg)
    say = print if s.is_main else (lambda *a, **k: None)
    if cfg.warmup.steps:
        supervised_warmup(s.trainer, s.tokenizer, s.task, cfg.warmup.steps, cfg.warmup.batch_size, cfg.warmup.lr, log=say)
        s.engine.update_weights(s.trainer.hf_weights())
    before = evaluate(s)
    s.logger.scalars(0, {"eval/pass_at_1": before})
    say(f"eval before RL: pass@1 {before:.3f} on {len(s.task.eval_problems)} held-out prompts")
    start, steps = time.time(), 0
    s.logger.reset_clock()
    for step in range(cfg.train.steps):
        if cfg.train.time_limit_s and time.time() - start > cfg.train.time_limit_s:
            say(f"time limit {cfg.train.time_limit_s:.0f}s reached after {steps} steps")
            break
        o = cfg.optim
        s.trainer.set_lr(lr_at(step, o.lr, o.lr_warmup_steps, o.lr_decay, cfg.train.steps, o.min_lr))
        metrics = rl_step(s, step)
        metrics["optim/lr"] = s.trainer.optimizer.param_groups[0]["lr"]
        steps += 1
        if cfg.train.eval_every and steps % cfg.train.eval_every == 0:
            metrics["eval/pass_at_1"] = evaluate(s)
        s.logger.scalars(steps, metrics)
        s.logger.progress(steps, metrics, CONSOLE_KEYS)
        export_policy(s, steps)
    export_policy(s, steps, final=True)
    after = evaluate(s)
    s.logger.scalars(steps, {"eval/pass_at_1": after})
    s.logger.close()
    say(f"eval after RL: pass@1 {after:.3f}")
    return {"pass_at_1_before": before, "pass_at_1_after": after, "steps": steps, "run_dir": str(s.run_dir)}


def main(argv: list[str] | None = None) -> int:
    from megarl.cli import main as cli_main

    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
