"""The warm-up on conversations (``warmup.path``): a tool-use episode is rendered token for token as a rollout of
the same episode builds it (the prompt through the chat template with ``tools=``, the tool's answer appended by
``rollout/turns.py``'s ``Episodes`` from a real tool environment), only the model's tokens train, bad rows are
refused before launch naming file, line and message; and a multi-turn run's pass@1 runs whole episodes."""

import json
from types import SimpleNamespace

import pytest
import torch

from megarl.config.errors import ConfigError
from megarl.config.schema import RunConfig
from megarl.config.validate import validate
from megarl.data import encode
from megarl.data.chat import TurnRenderer
from megarl.data.conversations import ConversationRenderer, check_conversations, read_conversations
from megarl.data.rows import DataError
from megarl.envs.pool import EnvPool
from megarl.envs.tools import prompt_tools
from megarl.models.tiny import CHATML_TEMPLATE, build_tokenizer
from megarl.rollout.turns import Episodes
from megarl.types import Sample

TOOLS = "helpers.envs:multiply, helpers.envs:lookup"
CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 4073, "b": 958}}</tool_call>'
EPISODE = [{"role": "user", "content": "What is 4073 * 958?"}, {"role": "assistant", "content": CALL},
           {"role": "tool", "content": "3901934"}, {"role": "assistant", "content": "3901934"}]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture
def tools_template(tmp_path):
    """ChatML with a tools section (as Qwen's and Hermes' templates have): the prompt differs with ``tools=``."""
    path = tmp_path / "tools.jinja"
    path.write_text("{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
                    "<|im_end|>\n{%- endif %}" + CHATML_TEMPLATE)
    return str(path)


def rollout_of(tok, template: str, turns: list[str], prompt_ids: list[int]) -> Sample:
    """The trajectory a rollout builds when the model samples ``turns`` (each its text's tokens then EOS): every
    turn that ended goes to a real tool environment in its worker, its answer appended by ``Episodes``."""
    pool = EnvPool("tools", workers=1, timeout_s=10, tools=TOOLS)
    episodes = Episodes(pool, TurnRenderer(tok, template), tok, max_turns=len(turns), max_tokens=400)
    s = Sample(list(prompt_ids))
    try:
        for turn in turns:
            s.response_ids += [*encode(tok, turn), tok.eos_token_id]
            s.versions += [0] * (len(s.response_ids) - len(s.versions))
            if episodes.turn_ended(0, 0, s, {}):
                again = []
                while not again:
                    again = episodes.answers(timeout=10.0)[0]
    finally:
        pool.close()
    return s


def test_a_tool_episode_renders_as_its_rollout_and_trains_only_the_models_tokens(tok, tools_template):
    tools = prompt_tools(SimpleNamespace(fn="tools", tools=TOOLS))
    render = ConversationRenderer(tok, tools_template, tools=tools)
    prompt_ids, response_ids, mask = render(EPISODE[:1], EPISODE[1:])
    assert tok.decode(prompt_ids).startswith("<|im_start|>system\nTools: multiply lookup<|im_end|>")  # tools shown

    s = rollout_of(tok, render.prompt.template, [CALL, "3901934"], render.prompt(EPISODE[:1])[1])
    assert s.env_messages == [{"role": "tool", "content": "3901934"}]  # (the real tool's answer is the trace's)
    assert (prompt_ids, response_ids, mask) == (s.prompt_ids, s.response_ids, s.model_mask())
    # ChatML is append-only: the whole conversation as the template renders it, to the model's last EOS
    whole = tok.apply_chat_template(EPISODE, chat_template=render.prompt.template, tools=tools, tokenize=True)
    whole = whole if isinstance(whole, list) else whole["input_ids"]
    assert whole[:len(prompt_ids) + len(response_ids)] == prompt_ids + response_ids

    trained = [t for t, m in zip(response_ids, mask) if m]
    assert tok.decode(trained) == f"{CALL}<|im_end|>3901934<|im_end|>"  # the model's turns and their EOS, no more
    masked = tok.decode([t for t, m in zip(response_ids, mask) if not m])
    assert masked == "\n<|im_start|>tool\n3901934<|im_end|>\n<|im_start|>assistant\n"


def test_the_warmup_loss_has_no_gradient_on_the_tools_tokens(tok, tmp_path):
    """The batch the warm-up builds gives the tool's tokens loss mask 0: changing their log-probabilities changes
    neither the NLL nor its gradient there (the loss reaches the model only through the model's tokens)."""
    from megarl.algo.batch import build_batch
    from megarl.algo.losses import nll_loss
    from megarl.trainer.sft import conversation_examples

    path = tmp_path / "warmup.jsonl"
    path.write_text(json.dumps({"messages": EPISODE}) + "\n" + json.dumps({"messages": EPISODE[:1] + [
        {"role": "assistant", "content": "3901934"}]}) + "\n")
    draw = conversation_examples(read_conversations(str(path)), ConversationRenderer(tok), seed=0, max_tokens=256)
    prompts, responses, masks = zip(*draw(2))
    batch = build_batch(list(prompts), list(responses), loss_agg="token_mean", model_masks=list(masks))
    logp = torch.randn(batch.loss_mask.shape, requires_grad=True)
    loss = (nll_loss(logp, batch.loss_mask)[0] * batch.weights).sum()
    loss.backward()
    trained = int(batch.loss_mask.sum())
    assert trained == sum(sum(m) for m in masks) and trained < sum(len(r) for r in responses)
    assert torch.all(logp.grad[batch.loss_mask == 0] == 0) and torch.all(logp.grad[batch.loss_mask == 1] != 0)


@pytest.mark.parametrize("messages,error", [
    ([{"role": "user", "content": "hi"}], "no assistant message"),
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], "no prompt before"),
    (EPISODE[:3], "ends with a 'tool' message"),
    (EPISODE[:2] + [EPISODE[3]], "message 2 has role 'assistant' where 'tool' or 'user' was expected"),
    (EPISODE[:2] + [{"role": "calculator", "content": "1"}, EPISODE[3]], "role 'calculator'"),
    ([{"role": "user", "content": 7}, EPISODE[1]], "message 0 is not a {'role': str, 'content': str}"),
    ("What is 2 * 3?", "a warm-up row is {\"messages\""),
])
def test_a_bad_conversation_is_refused_naming_file_line_and_message(tmp_path, messages, error):
    path = tmp_path / "warmup.jsonl"
    path.write_text(json.dumps({"messages": EPISODE}) + "\n" + json.dumps({"messages": messages}) + "\n")
    cfg = RunConfig()
    cfg.warmup.path, cfg.warmup.steps = str(path), 10
    with pytest.raises(DataError, match=rf"warmup.path='.*warmup.jsonl': .*warmup.jsonl:.*2.*{_re(error)}"):
        check_conversations(cfg)


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_warmup_keys_are_checked_against_each_other(tmp_path):
    cfg = RunConfig()
    cfg.data.path, cfg.reward.fn, cfg.warmup.steps = "train.jsonl", "exact", 10
    with pytest.raises(ConfigError, match="warmup.steps=10 with data.path='train.jsonl' needs warmup.path"):
        validate(cfg, 1)
    cfg.warmup.steps, cfg.warmup.path = 0, "warmup.jsonl"
    with pytest.raises(ConfigError, match="warmup.path='warmup.jsonl' is read by the warm-up: set warmup.steps"):
        validate(cfg, 1)
    cfg.warmup.steps = 10
    validate(cfg, 1)
    cfg.warmup.path = str(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match="warmup.path"):
        check_conversations(cfg)


class CopyingModel:
    """An engine whose model has learnt the tool arm's warm-up (a stand-in for vLLM, which ``test_calculator``
    runs): its first turn calls ``multiply`` on the prompt's numbers, the next copies the tool's answer;
    ``direct=True``: it answers at once with the sum instead (a wrong answer, no tool)."""

    def __init__(self, tok, direct: bool = False) -> None:
        self.tok, self.direct, self.requests = tok, direct, []

    def generate(self, requests, seed: int):
        from megarl.types import Completion

        out = []
        for r in requests:
            self.requests.append(r)
            text = self.tok.decode(r.prompt_ids)
            if "<|im_start|>tool\n" in text:
                reply = text.split("<|im_start|>tool\n")[-1].split("<|im_end|>")[0]
            else:
                a, b = (int(x) for x in text.split("What is ")[-1].split("?")[0].split(" * "))
                reply = str(a + b) if self.direct else \
                    f'<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
            ids = [*encode(self.tok, reply), self.tok.eos_token_id]
            out.append([Completion(ids, [0.0] * len(ids), "stop")])
        return out


def test_pass_at_1_of_a_multi_turn_run_plays_whole_episodes_with_the_tool(tok):
    from megarl.data.chat import PromptRenderer
    from megarl.data.source import Prompt
    from megarl.rewards.pool import RewardPool
    from megarl.rollout.evaluate import pass_rates

    render = PromptRenderer(tok)
    prompts = [Prompt(i, render(f"What is {a} * {b}?")[1], "", str(a * b)) for i, (a, b) in
               enumerate([(4073, 958), (12, 7), (305, 41)])]
    rewards = RewardPool("exact", workers=1)  # (scored on the episode's last model turn)
    envs = Episodes(EnvPool("tools", workers=1, timeout_s=10, tools=TOOLS), TurnRenderer(tok, render.template), tok,
                    max_turns=2, max_tokens=120)
    try:
        model = CopyingModel(tok)
        assert pass_rates(model, tok, prompts, rewards, 120, episodes=envs)["pass_at_1"] == 1.0
        assert len(model.requests) == 6 and all(r.greedy for r in model.requests)  # two turns each
        assert model.requests[3].max_tokens < 120  # (the second turn's budget: what the first and the tool left)
        assert pass_rates(CopyingModel(tok, direct=True), tok, prompts, rewards, 120, episodes=envs)[
            "pass_at_1"] == 0.0
    finally:
        rewards.close()
        envs.close()
