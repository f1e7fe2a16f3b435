"""Prompt items from a task, and group scoring: the glue between data, rewards and the controller."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

from megarl.data import encode
from megarl.rewards.base import RewardRunner
from megarl.rollout.controller import PromptItem
from megarl.types import Group


def task_prompt_source(task, tokenizer) -> Callable[[], PromptItem]:
    """Endless prompts from ``task``, tokenised; the prompt text is the length-cache key."""
    counter = itertools.count()

    def next_prompt() -> PromptItem:
        problem = task.next_problem()
        ids = encode(tokenizer, problem.prompt)
        return PromptItem(next(counter), ids, problem.prompt, problem.answer, key=problem.prompt)

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


def group_scorer(tokenizer, rewards: RewardRunner) -> Callable[[Group], None]:
    """Decode each sample of a released group and fill in its reward."""

    def score(group: Group) -> None:
        for s in group.samples:
            s.text = tokenizer.decode(s.response_ids, skip_special_tokens=True)
        scores = rewards.score([(s.text, group.answer) for s in group.samples])
        for s, r in zip(group.samples, scores):
            s.reward = r

    return score


def tracking_scorer(score: Callable[[Group], None], tracker) -> Callable[[Group], None]:
    """``score`` that also feeds each released group's rewards to a pass-rate tracker."""

    def scored_and_tracked(group: Group) -> None:
        score(group)
        tracker.update(group.prompt_text, [s.reward for s in group.samples])

    return scored_and_tracked
