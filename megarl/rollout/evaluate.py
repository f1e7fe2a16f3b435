"""Pass@1 (greedy) and pass@k (sampled) of an engine on held-out prompts: the training loop's periodic
eval and ``megarl eval`` run this same function.

pass@k is the unbiased estimator of Chen et al. 2021 (Codex): with n samples of which c
are correct, pass@k = 1 − C(n−c, k) / C(n, k), averaged over prompts. A sample is
correct when its reward is ≥ 1 (a built-in reward with ``format_coef`` reports its
correctness apart from the format term).

With an environment (``env.fn``) each sample is a whole episode, run turn by turn: every unfinished episode's next
turn generated in one batch (its trajectory so far as the prompt), the turns that ended with EOS answered by the
environments (a pool of their own, ``episodes``), the answers appended as ``rollout/turns.py`` appends them, until
every episode ended. It is scored as training scores it: its last model turn, with its ``transcript``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from math import comb

from megarl.engines.protocol import Engines
from megarl.rollout.turns import Episodes, transcript
from megarl.types import GenerationRequest, Sample


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 − C(n−c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _correct(engine: Engines, tokenizer, prompts, requests, rewards, seed: int) -> list[list[bool]]:
    outs = engine.generate(requests, seed=seed)
    items = [(tokenizer.decode(o.token_ids, skip_special_tokens=True), p.answer, p.extras, o.finish_reason)
             for p, out in zip(prompts, outs) for o in out]
    scores, extras = rewards.score_detailed(items)
    flat = [e.get("correct", s) >= 1.0 for s, e in zip(scores, extras)]
    per = len(flat) // max(1, len(prompts))
    return [flat[i * per:(i + 1) * per] for i in range(len(prompts))]


def _episodes_correct(engine: Engines, tokenizer, prompts, requests, rewards, seed: int, episodes: Episodes
                      ) -> list[list[bool]]:
    """``_correct`` of multi-turn episodes (see the module docstring); keys ``(-1 - prompt, sample)`` (the
    controller's are ``(group index >= 0, sample)``)."""
    samples = {(-1 - i, j): Sample(list(r.prompt_ids)) for i, r in enumerate(requests) for j in range(r.n)}
    todo, turn = list(samples), 0
    while todo:
        reqs = [GenerationRequest(samples[w].prompt_ids + samples[w].response_ids, 1,
                                  requests[-1 - w[0]].max_tokens - len(samples[w].response_ids),
                                  requests[-1 - w[0]].temperature, greedy=requests[-1 - w[0]].greedy) for w in todo]
        for where, out in zip(todo, engine.generate(reqs, seed=seed + turn)):
            s, c = samples[where], out[0]
            s.response_ids += c.token_ids
            s.versions += [0] * len(c.token_ids)
            s.finish_reason = c.finish_reason
            if c.finish_reason == "stop":
                episodes.turn_ended(*where, s, prompts[-1 - where[0]].extras)
        todo, turn = [], turn + 1
        while episodes.pending():
            todo += episodes.answers(timeout=episodes.pool.timeout_s + 1.0)[0]
        todo.sort(key=lambda w: (-w[0], w[1]))
    items = []
    for (i, _), s in samples.items():
        messages = transcript(s, tokenizer)
        items.append((messages[-1]["content"], prompts[-1 - i].answer, prompts[-1 - i].extras, s.finish_reason,
                      messages))
    scores, extras = rewards.score_detailed(items)
    flat = [e.get("correct", x) >= 1.0 for x, e in zip(scores, extras)]
    return [flat[sum(r.n for r in requests[:i]):sum(r.n for r in requests[:i + 1])] for i in range(len(requests))]


def pass_rates(engine: Engines, tokenizer, prompts: list, rewards, max_tokens: int, samples: int = 1,
               temperature: float = 1.0, chunk: int = 64, progress: bool = False,
               episodes: Callable[[], Episodes] | None = None) -> dict[str, float]:
    """``pass_at_1`` (greedy) on ``prompts`` (``megarl.data.source.Prompt``); with ``samples`` = k > 1 also
    ``pass_at_1_sampled`` and ``pass_at_<j>`` for j = 2, 4, … ≤ k from k samples at ``temperature``.
    ``episodes``: builds the environments of a multi-turn run (``rollout.turns.build_episodes``; closed after)."""
    if not prompts:
        return {"pass_at_1": float("nan"), "prompts": 0}
    envs = episodes() if episodes is not None else None
    correct = _correct if envs is None else functools.partial(_episodes_correct, episodes=envs)
    try:
        return _pass_rates(correct, engine, tokenizer, prompts, rewards, max_tokens, samples, temperature, chunk,
                           progress)
    finally:
        if envs is not None:
            envs.pool.close()


def _pass_rates(correct, engine, tokenizer, prompts, rewards, max_tokens, samples, temperature, chunk, progress):
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), desc="eval", unit="prompt")
    greedy, sampled = [], []
    for start in range(0, len(prompts), chunk):
        part = prompts[start:start + chunk]
        reqs = [GenerationRequest(p.ids, n=1, max_tokens=max_tokens, greedy=True) for p in part]
        greedy += [c[0] for c in correct(engine, tokenizer, part, reqs, rewards, seed=0)]
        if samples > 1:
            reqs = [GenerationRequest(p.ids, n=samples, max_tokens=max_tokens, temperature=temperature) for p in part]
            sampled += correct(engine, tokenizer, part, reqs, rewards, seed=1)
        if bar is not None:
            bar.update(len(part))
    if bar is not None:
        bar.close()
    out = {"pass_at_1": sum(greedy) / len(greedy), "prompts": len(prompts)}
    if samples > 1:
        out["pass_at_1_sampled"] = sum(sum(c) for c in sampled) / (samples * len(sampled))
        k = 2
        while k <= samples:
            out[f"pass_at_{k}"] = sum(pass_at_k(samples, sum(c), k) for c in sampled) / len(sampled)
            k *= 2
        if samples not in (1, *(2**i for i in range(1, 20))):
            out[f"pass_at_{samples}"] = sum(pass_at_k(samples, sum(c), samples) for c in sampled) / len(sampled)
    return out
