"""Pass@1 (greedy) and pass@k (sampled) of an engine on held-out prompts: the training loop's periodic
eval and ``megarl eval`` run this same function.

pass@k is the unbiased estimator of Chen et al. 2021 (Codex): with n samples of which c
are correct, pass@k = 1 − C(n−c, k) / C(n, k), averaged over prompts. A sample is
correct when its reward is ≥ 1 (a built-in reward with ``format_coef`` reports its
correctness apart from the format term).

With an environment (``env.fn``: ``episodes``, the evaluation's own) each sample is an episode played to its end
(``episode_eval.py``): pass@k counts it correct by its last turn, and ``pass_at_1_first_turn`` (its first turn
alone), ``turns_mean`` and ``env_errors`` (greedy episodes an environment failure ended) come with it.
"""

from __future__ import annotations

from math import comb

from megarl.engines.protocol import Engines
from megarl.rollout.episode_eval import play_episodes, score_episodes
from megarl.types import GenerationRequest


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 − C(n−c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _correct(engine: Engines, tokenizer, prompts, requests, rewards, seed: int, episodes=None,
             details: dict | None = None) -> list[list[bool]]:
    """Per prompt, whether each of its request's samples is correct. With ``episodes``: by the episode's last turn,
    and ``details`` (a dict) collects the first turns' correctness, the turns and the environment failures."""
    if episodes is not None:
        played = play_episodes(engine, episodes, prompts, requests, seed)
        final, first = score_episodes(played, prompts, tokenizer, rewards)
        if details is not None:
            details["first"] += [f[0] for f in first]
            details["turns"] += [eps[0].sample.turns for eps in played]
            details["env_errors"] += sum(bool(eps[0].sample.env_error) for eps in played)
        return final
    outs = engine.generate(requests, seed=seed)
    items = [(tokenizer.decode(o.token_ids, skip_special_tokens=True), p.answer, p.extras, o.finish_reason)
             for p, out in zip(prompts, outs) for o in out]
    scores, extras = rewards.score_detailed(items)
    flat = [e.get("correct", s) >= 1.0 for s, e in zip(scores, extras)]
    per = len(flat) // max(1, len(prompts))
    return [flat[i * per:(i + 1) * per] for i in range(len(prompts))]


def pass_rates(engine: Engines, tokenizer, prompts: list, rewards, max_tokens: int, samples: int = 1,
             temperature: float = 1.0, chunk: int = 64, progress: bool = False, episodes=None) -> dict[str, float]:
    """``pass_at_1`` (greedy) on ``prompts`` (``megarl.data.source.Prompt``); with ``samples`` = k > 1 also
    ``pass_at_1_sampled`` and ``pass_at_<j>`` for j = 2, 4, … ≤ k from k samples at ``temperature``.
    ``episodes`` (``turns.Episodes``): multi-turn, see the module docstring."""
    if not prompts:
        return {"pass_at_1": float("nan"), "prompts": 0}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), desc="eval", unit="prompt")
    greedy, sampled, turns = [], [], {"first": [], "turns": [], "env_errors": 0}
    for start in range(0, len(prompts), chunk):
        part = prompts[start:start + chunk]
        reqs = [GenerationRequest(p.ids, n=1, max_tokens=max_tokens, greedy=True) for p in part]
        greedy += [c[0] for c in _correct(engine, tokenizer, part, reqs, rewards, 0, episodes, turns)]
        if samples > 1:
            reqs = [GenerationRequest(p.ids, n=samples, max_tokens=max_tokens, temperature=temperature) for p in part]
            sampled += _correct(engine, tokenizer, part, reqs, rewards, 1, episodes)
        if bar is not None:
            bar.update(len(part))
    if bar is not None:
        bar.close()
    out = {"pass_at_1": sum(greedy) / len(greedy), "prompts": len(prompts)}
    if episodes is not None:
        out.update(pass_at_1_first_turn=sum(turns["first"]) / len(greedy),
                   turns_mean=sum(turns["turns"]) / len(greedy), env_errors=turns["env_errors"])
    if samples > 1:
        out["pass_at_1_sampled"] = sum(sum(c) for c in sampled) / (samples * len(sampled))
        k = 2
        while k <= samples:
            out[f"pass_at_{k}"] = sum(pass_at_k(samples, sum(c), k) for c in sampled) / len(sampled)
            k *= 2
        if samples not in (1, *(2**i for i in range(1, 20))):
            out[f"pass_at_{samples}"] = sum(pass_at_k(samples, sum(c), samples) for c in sampled) / len(sampled)
    return out
