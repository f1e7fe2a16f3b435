"""Prompt items from a task, and group scoring: the glue between data, rewards and the controller."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

from megarl.data import encode
from megarl.rewards.pool import RewardPool
from megarl.rollout.controller import PromptItem
from megarl.types import Group


def prompt_source(prompts, extras: dict) -> Callable[[], PromptItem]:
    """Controller prompts from a data source (``megarl.data.source``); each row's extra columns are kept in
    ``extras`` under the prompt's index until its group is scored."""

    def next_prompt() -> PromptItem:
        p = prompts.next()
        if p.extras:
            extras[p.index] = p.extras
        return PromptItem(p.index, p.ids, p.text, p.answer, key=p.key)

    return next_prompt


def pool_prompt_source(pool: list, tokenizer, seed: int, draw: Callable[[], object] | None = None
                       ) -> Callable[[], PromptItem]:
    """Prompts from a finite pool: drawn by ``draw`` (the curriculum) or uniformly with a seeded RNG."""
    counter, rng = itertools.count(), random.Random(seed)

    def next_prompt() -> PromptItem:
        problem = draw() if draw is not None else rng.choice(pool)
        ids = encode(tokenizer, problem.prompt)
        return PromptItem(next(counter), ids, problem.prompt, problem.answer, key=problem.prompt)

    return next_prompt


def group_scorer(tokenizer, rewards: RewardPool, extras: dict | None = None) -> Callable[[Group], None]:
    """Decode each sample of a released group and fill in its reward (the row's extras as keyword args)."""

    def score(group: Group) -> None:
        for s in group.samples:
            s.text = tokenizer.decode(s.response_ids, skip_special_tokens=True)
        row = extras.pop(group.prompt_index, {}) if extras is not None else {}
        scores = rewards.score([(s.text, group.answer, row) for s in group.samples])
        for s, r in zip(group.samples, scores):
            s.reward = r

    return score


def tracking_scorer(score: Callable[[Group], None], tracker) -> Callable[[Group], None]:
    """``score`` that also feeds each released group's rewards to a pass-rate tracker."""

    def scored_and_tracked(group: Group) -> None:
        score(group)
        tracker.update(group.prompt_text, [s.reward for s in group.samples])

    return scored_and_tracked
