"""Held-out evaluation of multi-turn episodes (``env.fn``): each prompt played to its episode's end, turn by turn,
on the engines' batch ``generate``, outside the controller.

::

    turn 1: every request generated (greedy, or sampled) ──► each sample's first turn kept (pass@1 at the first turn)
      a turn that ended with EOS ──► its environment (``turns.Episodes``: the same pool, rendering and
      ``env.max_turns`` / ``rollout.max_new_tokens`` bounds as training) ──► a message: its tokens appended
    turn k: the samples the environments answered generated again from their whole trajectory, one batch
    ... until no sample waits; each sample is then scored on its last model turn, with its ``transcript``

The environments are an evaluation's own (``Session.eval_episodes``: their own worker pool), so an evaluation never
takes the answers meant for the controller's episodes (a phase in flight under ``rollout.overlap``). With several
trainer ranks the pool's answers are shared from rank 0 (``Episodes``' ``shared``), so every rank plays the same
episodes in lockstep.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megarl.rollout.turns import Episodes, transcript
from megarl.types import GenerationRequest, Sample

POLL_S = 1.0  # the longest one wait for an environment's answer blocks (then it looks again)


@dataclass
class Episode:
    """One evaluated sample: its whole trajectory (``sample``) and its first model turn as it was sampled."""

    sample: Sample
    first_ids: list[int]
    first_finish: str


def play_episodes(engines, episodes: Episodes, prompts: list, requests: list[GenerationRequest],
                  seed: int) -> list[list[Episode]]:
    """Every completion of ``requests`` (one per prompt of ``prompts``) played as an episode to its end: per prompt,
    its ``request.n`` episodes. Later turns are sampled as the first (greedy, or at its temperature), one each."""
    episodes.sweep({})  # (the episodes an evaluation that failed midway left: ended, their late answers ignored)
    outs = engines.generate(requests, seed=seed)
    played = [[Episode(Sample(p.ids), list(c.token_ids), c.finish_reason) for c in out]
              for p, out in zip(prompts, outs)]
    turn = [((i, j), c) for i, out in enumerate(outs) for j, c in enumerate(out)]
    for k in range(1, episodes.max_turns + 1):
        for (i, j), c in turn:
            s = played[i][j].sample
            s.response_ids += c.token_ids
            s.logprobs += [0.0] * len(c.token_ids)
            s.finish_reason = c.finish_reason
            if c.finish_reason == "stop":  # (waits on its environment, or its episode is over)
                episodes.turn_ended(i, j, s, prompts[i].extras)
        again = []
        while episodes.pending():  # (every rank loops alike: ``answers`` shares rank 0's)
            again += episodes.answers(POLL_S)[0]
        if not again:
            break
        asked = [(where, played[where[0]][where[1]].sample) for where in again]
        nexts = engines.generate([replace(requests[i], prompt_ids=s.prompt_ids + s.response_ids, n=1,
                                          max_tokens=episodes.max_tokens - len(s.response_ids))
                                  for (i, _), s in asked], seed=seed + k)
        turn = [(where, out[0]) for (where, _), out in zip(asked, nexts)]
    episodes.sweep({})  # every episode of this evaluation over: its instances (a turn cut at the length cap's
    # too) dropped from the workers
    return played


def score_episodes(played: list[list[Episode]], prompts: list, tokenizer, rewards) -> tuple[list, list]:
    """Per prompt, per episode: (correct by its last turn, correct at its first turn); correct is a reward (or its
    ``correct`` part) ≥ 1. The last turn is scored with its ``transcript``, the first as a single-turn response."""
    items = []
    for p, eps in zip(prompts, played):
        for e in eps:
            messages = transcript(e.sample, tokenizer)
            first = tokenizer.decode(e.first_ids, skip_special_tokens=True)
            items.append((messages[-1]["content"], p.answer, p.extras, e.sample.finish_reason, messages))
            items.append((first, p.answer, p.extras, e.first_finish, [{"role": "assistant", "content": first}]))
    scores, extras = rewards.score_detailed(items)
    flat = [x.get("correct", s) >= 1.0 for s, x in zip(scores, extras)]
    final, first, at = [], [], 0
    for eps in played:
        n = 2 * len(eps)
        final.append(flat[at:at + n:2])
        first.append(flat[at + 1:at + n:2])
        at += n
    return final, first


def examples(played: list[list[Episode]], prompts: list, tokenizer) -> list[dict]:
    """The first episode of each prompt as ``megarl eval`` shows it: the prompt, its answer and the transcript."""
    return [{"prompt": p.text, "answer": p.answer, "transcript": transcript(eps[0].sample, tokenizer)}
            for p, eps in zip(prompts, played)]


def summary(result: dict) -> str:
    """A multi-turn evaluation's figures in one line (``pass_rates``' result)."""
    return (f"pass@1 {result['pass_at_1']:.3f} by the last turn, {result['pass_at_1_first_turn']:.3f} at the first; "
            f"{result['turns_mean']:.2f} turns per episode, {result['env_errors']} ended by an environment failure")
