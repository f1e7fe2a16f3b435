"""Supervised warm-up on reference responses (next-token NLL on the response tokens)."""

from __future__ import annotations

import time

from megarl.algo.batch import build_batch
from megarl.algo.losses import nll_loss
from megarl.data import encode, pad_id
from megarl.trainer.policy import PolicyTrainer


def supervised_warmup(trainer: PolicyTrainer, tokenizer, task, steps: int, batch_size: int, lr: float,
                      log_every: int = 10, log=print) -> list[float]:
    """``steps`` Adam steps on (prompt, reference response + EOS); returns the NLL per step."""
    trainer.set_lr(lr)
    eos = tokenizer.eos_token_id
    history, start = [], time.time()
    for step in range(1, steps + 1):
        problems = task.next_problems(batch_size)
        prompts = [encode(tokenizer, p.prompt) for p in problems]
        responses = [encode(tokenizer, p.response) + [eos] for p in problems]
        batch = build_batch(prompts, responses, loss_agg="token_mean", pad_id=pad_id(tokenizer))
        metrics = trainer.train_step(batch, lambda logp, mb: nll_loss(logp, mb["loss_mask"]))
        history.append(metrics.get("nll", float("nan")))
        if step % log_every == 0 or step == steps:
            elapsed = time.time() - start
            log(f"warmup {step}/{steps} | nll {history[-1]:.4f} | eta {elapsed / step * (steps - step):.0f}s")
    return history
