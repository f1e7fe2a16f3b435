"""The synchronous rollout: generate every group of a step at once and wait for the longest.

This is the baseline the SortedRL controller is measured against. Generation goes
through the engine; scoring through the reward runner; nothing here imports vLLM.
"""

from __future__ import annotations

from megarl.data.addition import Problem
from megarl.engines.base import Engine, GenerationRequest
from megarl.rewards.base import RewardRunner
from megarl.types import Group, Sample, SampleStatus


def generate_groups(engine: Engine, tokenizer, problems: list[Problem], start_index: int, group_size: int,
                    max_tokens: int, temperature: float, top_p: float, seed: int, version: int) -> list[Group]:
    """G sampled responses for each problem, with per-token behaviour logprobs and versions."""
    prompt_ids = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]
    requests = [GenerationRequest(ids, n=group_size, max_tokens=max_tokens, temperature=temperature, top_p=top_p)
                for ids in prompt_ids]
    groups = []
    for i, (problem, ids, completions) in enumerate(zip(problems, prompt_ids, engine.generate(requests, seed))):
        samples = []
        for c in completions:
            samples.append(Sample(
                prompt_ids=ids,
                response_ids=c.token_ids,
                logprobs=c.logprobs,
                versions=[version] * len(c.token_ids),
                status=SampleStatus.FINISHED if c.finish_reason == "stop" else SampleStatus.TRUNCATED,
                text=tokenizer.decode(c.token_ids, skip_special_tokens=True),
            ))
        groups.append(Group(start_index + i, problem.prompt, problem.answer, samples))
    return groups


def score_groups(groups: list[Group], rewards: RewardRunner) -> None:
    """Fill each sample's reward in place."""
    samples = [s for g in groups for s in g.samples]
    answers = [g.answer for g in groups for _ in g.samples]
    for s, r in zip(samples, rewards.score([(s.text, a) for s, a in zip(samples, answers)])):
        s.reward = r
