"""Supervised warm-up (``warmup.*``): next-token NLL on the model's tokens of reference episodes.

The examples come from ``warmup.path`` (chat conversations, multi-turn ones with the environment's tokens masked:
``megarl/data/conversations.py``) or, without it, from the built-in task's reference responses.

A preempted warm-up goes on where it stopped (``RunKeeper.warm_up`` asks ``stop`` before each step, saves the
steps done and the examples they drew, and resumes from the next): the policy's weights and Adam state come from the
checkpoint, and the example stream is put where it was. The task's stream is the task itself, whose cursor the run
checkpoint restores; a conversation stream is derived again from its seed, the examples drawn skipped.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from megarl.algo.batch import build_batch
from megarl.algo.losses import nll_loss
from megarl.data import encode, pad_id
from megarl.data.conversations import ConversationRenderer, read_conversations
from megarl.envs.tools import prompt_tools
from megarl.trainer.policy import PolicyTrainer

Example = tuple[list[int], list[int], list[float]]
"""(prompt ids, response ids, per response token 1.0 where it trains and 0.0 where it is the environment's)."""


def task_examples(task, tokenizer) -> Callable[[int], list[Example]]:
    """The built-in task's next problems with their reference responses (+ EOS), every response token trained."""
    eos = tokenizer.eos_token_id

    def draw(n: int) -> list[Example]:
        out = []
        for p in task.next_problems(n):
            response = [*encode(tokenizer, p.response), eos]
            out.append((encode(tokenizer, p.prompt), response, [1.0] * len(response)))
        return out

    return draw


def conversation_examples(conversations: list, render, seed: int, max_tokens: int = 0, skip: int = 0
                          ) -> Callable[[int], list[Example]]:
    """``(where, prompt, episode)`` rows (``read_conversations``) rendered once by ``render``
    (``ConversationRenderer``), drawn in a shuffled order each epoch (seeded). ``max_tokens``: a row longer than this
    (prompt and response) is refused, naming it (the engine could never generate it). ``skip``: the stream starts
    after that many draws (a resumed warm-up's), as if they had been made."""
    examples = []
    for where, prompt, episode in conversations:
        ex = render(prompt, episode)
        if max_tokens and len(ex[0]) + len(ex[1]) > max_tokens:
            raise ValueError(f"warmup.path: {where}: the conversation is {len(ex[0]) + len(ex[1])} tokens, more than "
                             f"engine.max_model_len={max_tokens}; shorten it or raise engine.max_model_len")
        examples.append(ex)
    rng, order = random.Random(seed), []

    def draw(n: int) -> list[Example]:
        out = []
        while len(out) < n:
            if not order:
                order.extend(rng.sample(range(len(examples)), len(examples)))
            out.append(examples[order.pop()])
        return out

    draw(skip)  # (the order and its RNG are all the state: drawn again from the seed)
    return draw


def warmup_examples(cfg, tokenizer, task, drawn: int = 0) -> Callable[[int], list[Example]]:
    """The examples ``warmup.*`` asks for: ``warmup.path``'s conversations, rendered as the run's rollouts render
    them (its chat template, system prompt and ``env.tools``), else the built-in ``task``'s references; after
    ``drawn`` examples (a resumed warm-up: the conversations' stream skips them; the task's is where the restored
    ``task`` is)."""
    if not cfg.warmup.path:
        return task_examples(task, tokenizer)
    d = cfg.data
    render = ConversationRenderer(tokenizer, d.chat_template, d.system_prompt, prompt_tools(cfg.env),
                                  d.enable_thinking)
    return conversation_examples(read_conversations(cfg.warmup.path), render, d.seed, cfg.engine.max_model_len,
                                 skip=drawn)


def supervised_warmup(trainer: PolicyTrainer, tokenizer, examples: Callable[[int], list[Example]], steps: int,
                      batch_size: int, lr: float, log_every: int = 10, log=print, done: int = 0,
                      stop: Callable[[], bool] | None = None) -> list[float]:
    """Warm-up steps ``done + 1`` to ``steps`` (``done``: those a preempted warm-up took), one Adam step on
    ``examples(batch_size)`` each; before each step ``stop()`` (every rank calls it at the same point) may end
    the warm-up. Returns the NLL of each step taken."""
    trainer.set_lr(lr)
    history, start = [], time.time()
    for step in range(done + 1, steps + 1):
        if stop is not None and stop():
            break
        prompts, responses, masks = zip(*examples(batch_size))
        batch = build_batch(list(prompts), list(responses), loss_agg="token_mean", pad_id=pad_id(tokenizer),
                            model_masks=list(masks))
        metrics = trainer.train_step(batch, lambda logp, mb: nll_loss(logp, mb["loss_mask"]))
        history.append(metrics.get("nll", float("nan")))
        if step % log_every == 0 or step == steps:
            elapsed = time.time() - start
            log(f"warmup {step}/{steps} | nll {history[-1]:.4f} | eta {elapsed / len(history) * (steps - step):.0f}s")
    return history
