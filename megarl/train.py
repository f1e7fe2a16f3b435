"""The RL loop in one page: generate → reward → advantage → train → sync → log.

Run it with ``megarl train --config FILE [key=value ...]`` (or ``--nproc N`` for
torchrun). Every step calls into a room and nothing else:

- generate + reward: the SortedRL controller runs one phase on the engines and
  scores each group as it is released (``megarl/rollout``);
- advantage + train: ``rl_update`` builds the batch, the advantages of the chosen
  algorithm and takes the optimizer steps (``megarl/trainer/rl_update.py``);
- sync: the trainer's weights stream into the engines in memory, bucket by bucket, under one
  all-or-nothing protocol (``megarl/weight_sync/protocol.py``);
- checkpoint: resume, saves every ``train.save_every`` steps, preemption signals and faults, the supervised
  warm-up before RL with its own preemption checkpoint (``megarl/keeper.py``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from megarl.config import RunConfig
from megarl.convert.export import export_policy
from megarl.data import pad_id
from megarl.distributed.determinism import make_deterministic
from megarl.distributed.signals import Preemption
from megarl.evaluation import NO_EVAL_PATH
from megarl.keeper import RunKeeper, StopRun
from megarl.logging.console import main_only
from megarl.logging.metrics import final_pass_at_1
from megarl.rollout.episode_eval import summary
from megarl.rollout.evaluate import pass_rates
from megarl.rollout.pipeline import Rollout
from megarl.session import Session, build_session
from megarl.trainer.lr_schedule import policy_lr
from megarl.trainer.rl_update import rl_update

log = logging.getLogger(__name__)

CONSOLE_KEYS = ("reward/mean", "response/len_mean", "loss/policy", "rollout/bubble_ratio", "timing/gen_s",
                "timing/train_s", "eval/pass_at_1")


@dataclass
class RunResult:
    """What ``run`` gives the CLI: held-out pass@1 before and after RL, the steps done, and how the run ended."""

    run_dir: str
    steps: int
    pass_at_1_before: float = float("nan")
    pass_at_1_after: float = float("nan")  # NaN when the run stopped early or had nothing to train
    stopped: str = ""  # why the run stopped early ('' when it ran to its end)
    error: bool = False  # stopped by a fault: exit status 1
    requeue: bool = False  # stopped by an engine fault with a checkpoint: exit status 75 (requeue)


def pass_at_1(s: Session) -> float:
    """Greedy pass@1 of the engines on the held-out prompts (multi-turn: by each episode's last turn)."""
    out = pass_rates(s.engines, s.tokenizer, s.eval_prompts, s.rewards, s.cfg.rollout.max_new_tokens,
                     episodes=s.eval_episodes)
    if s.eval_episodes is not None:
        main_only(log.info, s.ps.rank)(f"eval: {summary(out)}")
    return out["pass_at_1"]


def rl_step(s: Session, step: int, keeper: RunKeeper | None = None) -> dict[str, float]:
    cfg = s.cfg
    torch.manual_seed(cfg.train.seed * 100003 + step)  # every rank alike (engine TP); replicas derive own streams
    version = s.policy_version  # updates made so far: staleness counts updates, not steps (a skipped step makes none)
    start = time.perf_counter()  # (the timeline's clock)
    rollout = (keeper.next_rollout(step, version) if keeper  # generated ahead or now (rollout.overlap); rewarded
               else Rollout(*s.controller.run_phase(version), {**s.rewards.step_metrics(), **s.prompts.metrics(),
                                                               "timing/gen_s": time.perf_counter() - start}))
    groups, phase = rollout.groups, rollout.phase
    t1 = time.time()
    if not groups:  # e.g. dynamic sampling found no informative group within its cap: nothing to learn
        # (its reward failures and bad rows are still logged: that is when they matter)
        log.info(f"step {step + 1}: no useful group released ({phase.groups_filtered} filtered); update skipped")
        return {**rollout.metrics, **phase.summary()}
    s.handover.to_train()  # engines sleep (engine.sleep_level); trainer state back on device
    updates = s.trainer.updates
    with s.timeline.span(s.trainer_track, "train"):
        metrics = rl_update(s.learners, groups, cfg, pad_id(s.tokenizer), step)  # advantage, train
    t2 = time.time()
    s.handover.to_generate()  # trainer state to host (trainer.offload_during_rollout); engines wake
    sync = {}
    if s.trainer.updates > updates:  # the policy moved (not in value pre-training, nor a non-finite step skipped)
        s.policy_version = version + 1
        sync = (keeper.sync(version + 1, done_steps=step + 1) if keeper  # all or nothing; survives engine errors
                else s.weight_sync.run(s.engines, version + 1).metrics())
    s.logger.histogram(step + 1, "rollout/staleness", phase.staleness)  # versions behind, per trained token
    rewards = [x.reward for g in groups for x in g.samples]
    lengths = [x.model_tokens for g in groups for x in g.samples]  # (the model's: no environment token)
    return {
        "reward/mean": sum(rewards) / len(rewards),
        "reward/pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards),
        **rollout.metrics,  # reward/errors, timeouts (+ _step), reward/<name>; data/epoch, bad_rows; pipeline/*
        "response/len_mean": sum(lengths) / len(lengths),
        "response/len_max": max(lengths),
        "timing/train_s": t2 - t1,
        **sync,
        **metrics,
        **phase.summary(),
        "timing/step_s": time.perf_counter() - start,  # the step's wall time: generation (or waiting for it) to sync
        **s.timeline.step_metrics(start, time.perf_counter(), s.trainer_track),  # engine idle, overlap
    }


def run(cfg: RunConfig) -> RunResult:
    if cfg.train.deterministic:
        make_deterministic()
    preemption = Preemption()  # before the session (minutes at scale): a signal while it starts is kept
    s = build_session(cfg)
    say = main_only(log.info, s.ps.rank)
    keeper = RunKeeper(s, preemption)
    steps = keeper.resume()  # 0, or the steps of the checkpoint this run continues from
    if steps and steps >= cfg.train.steps:  # a finished run resubmitted: nothing to train, nothing to export again
        after = final_pass_at_1(s.run_dir / "metrics.jsonl")  # (its own evaluation after RL, as it recorded it)
        say(f"nothing to train: the run in {s.run_dir} finished at step {steps} (train.steps={cfg.train.steps}; "
            "train.resume=never starts afresh, setting it aside); its pass@1 after RL "
            + ("was not measured" if math.isnan(after) else f"was {after:.3f}"))
        s.close()
        return RunResult(str(s.run_dir), steps, keeper.run.get("pass_at_1_before", float("nan")), after)
    if not steps:
        keeper.warm_up()  # warmup.steps supervised steps (a preempted warm-up's rest), then the engines synced
        if keeper.stopped:  # preempted in the warm-up: its checkpoint (the warm-up steps done) saved, leave at once
            s.close()
            return RunResult(str(s.run_dir), steps, stopped=keeper.stopped)
        if s.eval_prompts and "pass_at_1_before" not in keeper.run:  # (a run resumed at step 0 measured it)
            keeper.run["pass_at_1_before"] = keeper.evaluate(lambda: pass_at_1(s), 0)  # survives engine errors
            s.logger.scalars(0, {"eval/pass_at_1": keeper.run["pass_at_1_before"]})
    before = keeper.run.get("pass_at_1_before", float("nan"))
    restored = (" (not measured by the run before step 1)" if math.isnan(before)
                else f" (measured by the run before step 1, restored at step {steps})")
    say((f"eval before RL: pass@1 {before:.3f} on {len(s.eval_prompts)} held-out prompts" + (restored if steps else ""))
        if s.eval_prompts else f"evaluation skipped: {NO_EVAL_PATH}")
    start = time.time()
    s.logger.reset_clock(steps)
    for step in range(steps, cfg.train.steps):
        if cfg.train.time_limit_s and time.time() - start > cfg.train.time_limit_s:
            say(f"time limit {cfg.train.time_limit_s:.0f}s reached after {steps} steps")
            break
        s.trainer.set_lr(policy_lr(cfg, step))
        try:
            metrics = rl_step(s, step, keeper)
        except StopRun as stop:
            keeper.stop(steps, stop)
            break
        metrics["optim/lr"] = s.trainer.optimizer.param_groups[0]["lr"]
        steps += 1
        if cfg.train.eval_every and s.eval_prompts and steps % cfg.train.eval_every == 0:
            metrics["eval/pass_at_1"] = keeper.evaluate(lambda: pass_at_1(s), steps)
        metrics.update(keeper.fault_metrics(steps))
        s.logger.scalars(steps, metrics)
        s.logger.progress(steps, metrics, CONSOLE_KEYS)
        export_policy(s, steps)  # every train.export_hf_every steps
        if keeper.end_of_step(steps):  # checkpoint every train.save_every steps; preemption, faults
            break
    result = RunResult(str(s.run_dir), steps, before, stopped=keeper.stopped, error=keeper.error,
                       requeue=keeper.requeue)
    if keeper.stopped:  # preempted or a fault: the checkpoint is saved, leave at once
        s.close()
        return result
    keeper.finish(steps)
    export_policy(s, steps, final=True)  # run_dir/hf/step_N
    if s.eval_prompts:
        result.pass_at_1_after = keeper.evaluate(lambda: pass_at_1(s), steps)
        s.logger.scalars(steps, {"eval/pass_at_1": result.pass_at_1_after}, final=True)
        say(f"eval after RL: pass@1 {result.pass_at_1_after:.3f}")
    s.close()
    return result
