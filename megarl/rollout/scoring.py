"""Prompt items from a task, and group scoring: the glue between data, rewards and the controller."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

from megarl.data import encode
from megarl.rewards.pool import RewardPool
from megarl.rollout.controller import PromptItem
from megarl.rollout.turns import transcript
from megarl.types import Group


class PromptFeed:
    """Controller prompts from a data source (``megarl.data.source``); each row's extra columns travel on its
    ``PromptItem`` to its released group (they were matched to groups by prompt text: two rows with the same text in
    flight swapped their extras when the later one finished first). The controller's checkpointed items carry
    them; ``state_dict`` holds the source's cursor.
    """

    def __init__(self, prompts) -> None:
        self.prompts = prompts

    def __call__(self) -> PromptItem:
        p = self.prompts.next()
        return PromptItem(p.index, p.ids, p.text, p.answer, key=p.key, extras=p.extras)

    def state_dict(self) -> dict:
        return {"source": self.prompts.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state["source"])


def pool_prompt_source(pool: list, tokenizer, seed: int, draw: Callable[[], object] | None = None
                       ) -> Callable[[], PromptItem]:
    """Prompts from a finite pool: drawn by ``draw`` (the curriculum) or uniformly with a seeded RNG."""
    counter, rng = itertools.count(), random.Random(seed)

    def next_prompt() -> PromptItem:
        problem = draw() if draw is not None else rng.choice(pool)
        ids = encode(tokenizer, problem.prompt)
        return PromptItem(next(counter), ids, problem.prompt, problem.answer, key=problem.prompt)

    return next_prompt


def group_scorer(tokenizer, rewards: RewardPool) -> Callable[[Group], None]:
    """Decode each sample of a released group and fill in its reward (its row's extra columns as keyword args)."""

    def score(group: Group) -> None:
        """A multi-turn sample is scored on its last model turn, with its ``transcript``."""
        items, row = [], group.extras or {}
        for s in group.samples:
            if s.env_spans:
                messages = transcript(s, tokenizer)
                s.text = messages[-1]["content"]
                items.append((s.text, group.answer, row, s.finish_reason, messages))
            else:
                s.text = tokenizer.decode(s.response_ids, skip_special_tokens=True)
                items.append((s.text, group.answer, row, s.finish_reason))
        scores = rewards.score(items)
        for s, r in zip(group.samples, scores):
            s.reward = r

    return score


def tracking_scorer(score: Callable[[Group], None], tracker) -> Callable[[Group], None]:
    """``score`` that also feeds each released group's rewards to a pass-rate tracker."""

    def scored_and_tracked(group: Group) -> None:
        score(group)
        tracker.update(group.prompt_text, [s.reward for s in group.samples])

    return scored_and_tracked


class RankZeroScores:
    """A reward pool whose ``score`` runs on rank 0 only and is broadcast to every rank.

    Every rank's controller scores each released group at the same point (lockstep); a reward
    that times out on one rank and not on another would split the controllers apart (different
    groups kept, different batches, a hang). One rank scores, all use its numbers."""

    def __init__(self, rewards) -> None:
        self.rewards = rewards

    def score(self, items: list) -> list[float]:
        import torch.distributed as dist

        out = [self.rewards.score(items) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(out, src=0)
        return out[0]

    def __getattr__(self, name: str):
        return getattr(self.rewards, name)


def shared_rewards(rewards):
    """``rewards`` scored once for all ranks (``RankZeroScores``) when several trainer processes run."""
    import torch.distributed as dist

    return RankZeroScores(rewards) if dist.is_initialized() and dist.get_world_size() > 1 else rewards
