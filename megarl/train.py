"""The RL loop in one page: generate → reward → advantage → train → sync → log.

Run it with ``megarl train --config FILE [key=value ...]`` (or under torchrun with
``python -m megarl.train``). Every step calls into a room and nothing else.
"""

from __future__ import annotations

import sys
import time

import torch

from megarl.algo.advantage import grpo_advantages
from megarl.algo.batch import build_batch
from megarl.algo.losses import ppo_clip_loss
from megarl.config import RunConfig
from megarl.rollout.evaluate import greedy_pass_at_1
from megarl.runtime import Session, build_session
from megarl.trainer.sft import supervised_warmup
from megarl.types import Group

CONSOLE_KEYS = ("reward/mean", "response/len_mean", "loss/policy", "timing/gen_s", "timing/train_s")


def rl_batch(groups: list[Group], cfg: RunConfig, pad_id: int):
    """Advantages per group (GRPO), then one padded batch of every sample."""
    rewards = torch.tensor([[s.reward for s in g.samples] for g in groups])
    adv = grpo_advantages(rewards).flatten().tolist()
    samples = [s for g in groups for s in g.samples]
    return build_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                       [s.logprobs for s in samples], adv, loss_agg=cfg.algo.loss_agg, pad_id=pad_id)


def policy_loss(cfg: RunConfig):
    def loss(logp, mb):
        return ppo_clip_loss(logp, mb["old_logprobs"], mb["advantages"], mb["loss_mask"],
                             cfg.algo.clip_low, cfg.algo.clip_high)
    return loss


def evaluate(s: Session) -> float:
    return greedy_pass_at_1(s.engine, s.tokenizer, s.task.eval_problems, s.cfg.rollout.max_new_tokens, s.rewards)


def rl_step(s: Session, step: int) -> dict[str, float]:
    cfg, t0 = s.cfg, time.time()
    torch.manual_seed(cfg.train.seed * 100003 + step)  # every rank samples alike (engine TP)
    groups, phase = s.controller.run_phase(version=step)
    t1 = time.time()
    if not groups:
        raise RuntimeError("the rollout phase released no group (prompt source exhausted?)")
    metrics = s.trainer.train_step(rl_batch(groups, cfg, s.tokenizer.pad_token_id), policy_loss(cfg))
    t2 = time.time()
    s.engine.update_weights(s.trainer.hf_weights())
    t3 = time.time()
    rewards = [x.reward for g in groups for x in g.samples]
    lengths = [len(x.response_ids) for g in groups for x in g.samples]
    return {
        "reward/mean": sum(rewards) / len(rewards),
        "reward/pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards),
        "response/len_mean": sum(lengths) / len(lengths),
        "response/len_max": max(lengths),
        "loss/policy": metrics.get("loss", 0.0),
        "loss/clip_frac": metrics.get("clip_frac", 0.0),
        "loss/approx_kl": metrics.get("approx_kl", 0.0),
        "loss/grad_norm": metrics["grad_norm"],
        "reward/errors": float(s.rewards.errors + s.rewards.timeouts),
        "timing/gen_s": t1 - t0,
        "timing/train_s": t2 - t1,
        "timing/sync_s": t3 - t2,
        **phase.summary(),
    }


def run(cfg: RunConfig) -> dict:
    s = build_session(cfg)
    say = print if s.is_main else (lambda *a, **k: None)
    if cfg.warmup.steps:
        supervised_warmup(s.trainer, s.tokenizer, s.task, cfg.warmup.steps, cfg.warmup.batch_size, cfg.warmup.lr, log=say)
        s.engine.update_weights(s.trainer.hf_weights())
    s.trainer.set_lr(cfg.optim.lr)
    before = evaluate(s)
    s.logger.scalars(0, {"eval/pass_at_1": before})
    say(f"eval before RL: pass@1 {before:.3f} on {len(s.task.eval_problems)} held-out prompts")
    start, steps = time.time(), 0
    s.logger.reset_clock()
    for step in range(cfg.train.steps):
        if cfg.train.time_limit_s and time.time() - start > cfg.train.time_limit_s:
            say(f"time limit {cfg.train.time_limit_s:.0f}s reached after {steps} steps")
            break
        metrics = rl_step(s, step)
        steps += 1
        if cfg.train.eval_every and steps % cfg.train.eval_every == 0:
            metrics["eval/pass_at_1"] = evaluate(s)
        s.logger.scalars(steps, metrics)
        s.logger.progress(steps, metrics, CONSOLE_KEYS + ("eval/pass_at_1",))
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
