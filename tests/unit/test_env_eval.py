"""Held-out evaluation of multi-turn episodes (``megarl/rollout/episode_eval.py``): each prompt played to its
episode's end with the example's ``Feedback`` environment in the real worker pool and the real ``math`` reward;
pass@1 counted by the last turn and at the first, the feedback rendered by the ChatML template, the model's tokens
as it produced them."""

import re

import pytest

from megarl.data.chat import TurnRenderer
from megarl.envs.pool import EnvPool
from megarl.models.tiny import CHATML_TEMPLATE, build_tokenizer
from megarl.rewards.pool import RewardPool
from megarl.rollout.episode_eval import play_episodes, summary
from megarl.rollout.evaluate import pass_rates
from megarl.rollout.turns import Episodes
from megarl.types import Completion, GenerationRequest


class Answers:
    """A batch engine (``Engines.generate``) whose model answers a prompt's k-th turn with ``script[question][k]``
    (its last entry once the script runs out) and EOS; each request it was given is kept (``requests``)."""

    def __init__(self, tok, script: dict[str, list[str]]) -> None:
        self.tok, self.script, self.requests = tok, script, []

    def generate(self, requests, seed: int) -> list[list[Completion]]:
        self.requests += requests
        out = []
        for r in requests:
            text = self.tok.decode(r.prompt_ids)
            question = re.search(r"user\n(.*?)<\|im_end\|>", text).group(1)
            turn = text.count("<|im_start|>assistant") - 1
            answers = self.script[question]
            ids = self.tok(answers[min(turn, len(answers) - 1)], add_special_tokens=False)["input_ids"]
            ids = (ids + [self.tok.eos_token_id])[:r.max_tokens]
            reason = "stop" if ids[-1] == self.tok.eos_token_id else "length"
            out.append([Completion(ids, [0.0] * len(ids), reason)] * r.n)
        return out


class Prompt:
    def __init__(self, tok, index, question, answer) -> None:
        self.index, self.text, self.answer, self.extras = index, question, answer, {"target": answer}
        messages = [{"role": "user", "content": question}]
        self.ids = tok.apply_chat_template(messages, chat_template=CHATML_TEMPLATE, add_generation_prompt=True,
                                           tokenize=True, return_dict=False)


@pytest.fixture(scope="module")
def parts():
    tok = build_tokenizer()
    pool = EnvPool("examples.smollm2.feedback:Feedback", workers=1, timeout_s=10.0)
    rewards = RewardPool("math", workers=1, timeout_s=10)
    yield tok, Episodes(pool, TurnRenderer(tok, CHATML_TEMPLATE), tok, max_turns=3, max_tokens=200), rewards
    pool.close()
    rewards.close()


def test_episodes_are_scored_by_their_last_turn_and_at_their_first(parts):
    tok, episodes, rewards = parts
    script = {"2 + 3?": ["5"], "4 + 4?": ["9", "8"], "7 - 1?": ["5", "4", "3", "6"], "1 + 1?": ["3", "4", "2"]}
    prompts = [Prompt(tok, i, q, a) for i, (q, a) in enumerate([("2 + 3?", "5"), ("4 + 4?", "8"), ("7 - 1?", "6"),
                                                                ("1 + 1?", "2")])]
    engine = Answers(tok, script)
    out = pass_rates(engine, tok, prompts, rewards, 200, episodes=episodes)
    # right at once; right at the second turn; never right in 3 turns (its 4th answer is never asked); right at the
    # third, the last turn env.max_turns allows
    assert out["pass_at_1"] == 3 / 4 and out["pass_at_1_first_turn"] == 1 / 4
    assert out["turns_mean"] == (1 + 2 + 3 + 3) / 4 and out["env_errors"] == 0
    assert "pass@1 0.750 by the last turn, 0.250 at the first; 2.25 turns" in summary(out)
    assert episodes.pending() == 0 and not episodes.keys  # every episode over: nothing left in the workers

    # the trajectory: the model's tokens as produced, the feedback as the template renders the whole conversation
    played = play_episodes(engine, episodes, prompts[1:2], [GenerationRequest(prompts[1].ids, greedy=True)], seed=0)
    s = played[0][0].sample
    conversation = [{"role": "user", "content": "4 + 4?"}, {"role": "assistant", "content": "9"},
                    {"role": "user", "content": "That is not right. Try again. Answer with just the number."},
                    {"role": "assistant", "content": "8"}]
    whole = tok.apply_chat_template(conversation, chat_template=CHATML_TEMPLATE, tokenize=False)
    assert tok.decode(s.prompt_ids + s.response_ids) == whole.removesuffix("\n")  # (the template's last newline)
    assert played[0][0].first_ids == tok("9", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    (start, end), = s.env_spans
    assert s.response_ids[:start] == played[0][0].first_ids
    assert engine.requests[-1].greedy and engine.requests[-1].prompt_ids == s.prompt_ids + s.response_ids[:end]
    assert engine.requests[-1].max_tokens == 200 - end  # (the episode's budget: rollout.max_new_tokens)


def test_an_answer_cut_at_the_length_cap_ends_its_episode_unscored_by_the_environment(parts):
    tok, episodes, rewards = parts
    prompts = [Prompt(tok, 0, "9 + 9?", "18")]
    engine = Answers(tok, {"9 + 9?": ["the answer is " + "very " * 200 + "18"]})  # past 200 tokens
    played = play_episodes(engine, episodes, prompts, [GenerationRequest(prompts[0].ids, max_tokens=200,
                                                                         greedy=True)], seed=0)
    s = played[0][0].sample
    assert s.finish_reason == "length" and s.turns == 1 and len(engine.requests) == 1  # never asked again
    assert pass_rates(engine, tok, prompts, rewards, 200, episodes=episodes)["turns_mean"] == 1.0
