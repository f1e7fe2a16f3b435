"""Greedy pass@1 on held-out prompts."""

from __future__ import annotations

from megarl.data import encode
from megarl.data.addition import Problem
from megarl.engines.base import Engine, GenerationRequest
from megarl.rewards.base import RewardRunner


def greedy_pass_at_1(engine: Engine, tokenizer, problems: list[Problem], max_tokens: int, rewards: RewardRunner) -> float:
    """Fraction of problems whose greedy response earns reward 1."""
    if not problems:
        return 0.0
    requests = [GenerationRequest(encode(tokenizer, p.prompt), n=1,
                                  max_tokens=max_tokens, greedy=True) for p in problems]
    outs = engine.generate(requests, seed=0)
    texts = [tokenizer.decode(o[0].token_ids, skip_special_tokens=True) for o in outs]
    scores = rewards.score([(t, p.answer) for t, p in zip(texts, problems)])
    return sum(1.0 for s in scores if s >= 1.0) / len(problems)
