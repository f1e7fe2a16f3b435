"""Prompts and multi-turn trajectories rendered with the real chat templates of Qwen3 (thinking on and off),
Qwen2.5 and Llama 3.1, as their hub tokenizers carry them (``helpers.chat_templates``): the prompt ids are the
template's own, and a tool or user message appended after the model's sampled turn is what the template writes for
it and the next generation prompt."""

import logging

import pytest

from helpers.chat_templates import with_template
from megarl.data import encode
from megarl.data.chat import PromptRenderer, TurnRenderer
from megarl.data.conversations import ConversationRenderer
from megarl.models.tiny import build_tokenizer
from megarl.types import Sample

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
EMPTY = "<think>\n\n</think>\n\n"  # what Qwen3 writes after the generation prompt with enable_thinking=False


@pytest.fixture(scope="module")
def tiny():
    return build_tokenizer()


@pytest.mark.parametrize("name,thinking", [("qwen3", "auto"), ("qwen3", True), ("qwen3", False),
                                           ("qwen2.5", "auto"), ("llama3.1", "auto"), ("llama3.1", False)])
def test_prompt_ids_are_the_templates_own(tiny, name, thinking):
    tok = with_template(tiny, name)
    text, ids = PromptRenderer(tok, "auto", enable_thinking=thinking)(PROMPT)
    switch = {} if thinking == "auto" else {"enable_thinking": thinking}
    assert ids == tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, **switch)["input_ids"]
    assert text.endswith(EMPTY) == (name == "qwen3" and thinking is False)
    if name == "llama3.1":  # a template that does not read the switch renders the same with it
        assert text == tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
        assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")


def episode(tok, conversation: list[dict], thinking="auto") -> tuple[Sample, TurnRenderer, list[list[int]]]:
    """The episode as the controller builds it: the prompt's ids, each model turn as sampled (its text's tokens and
    EOS), each environment message appended by the renderer."""
    render = TurnRenderer(tok, tok.chat_template, enable_thinking=thinking)
    s = Sample(PromptRenderer(tok, "auto", enable_thinking=thinking)(PROMPT)[1])
    sampled = []
    for m in conversation:
        if m["role"] == "assistant":
            ids = [*encode(tok, m["content"]), tok.eos_token_id]
            sampled.append(ids)
            s.response_ids += ids
            s.logprobs += [-0.5] * len(ids)
            s.versions += [0] * len(ids)
        else:
            s.add_env_turn(m, render(m))
    return s, render, sampled


TOOLS = [  # the model's turns (Qwen3 with thinking on: each with its reasoning) and tool answers
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nthe sum is 5"},
    {"role": "tool", "content": "checked: 2 + 3 = 5"},
    {"role": "assistant", "content": "<think>\nthe tool agrees\n</think>\n\nso 5"},
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "<think>\ndone\n</think>\n\n5"},
]
PLAIN = [{**m, "content": m["content"].split("\n\n")[-1]} if m["role"] == "assistant" else m for m in TOOLS]


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1"])
def test_append_only_templates_trajectory_is_the_whole_conversations_rendering(tiny, name):
    tok = with_template(tiny, name)
    conversation = [*PLAIN[:3], {"role": "user", "content": "and 2 + 4?"}, {"role": "assistant", "content": "6"}]
    s, render, sampled = episode(tok, conversation)
    assert render.append_only
    whole = tok.apply_chat_template([*PROMPT, *conversation], tokenize=True)["input_ids"]
    assert s.prompt_ids + s.response_ids + encode(tok, render.glue) == whole
    assert [ids for role, ids in s.segments() if role == "assistant"] == sampled
    answer = tok.decode(s.segments()[1][1])
    assert answer == {"qwen2.5": "\n<|im_start|>user\n<tool_response>\nchecked: 2 + 3 = 5\n</tool_response><|im_end|>"
                                 "\n<|im_start|>assistant\n",  # (Llama 3.1 writes a tool's content as JSON)
                      "llama3.1": '<|start_header_id|>ipython<|end_header_id|>\n\n"checked: 2 + 3 = 5"<|eot_id|>'
                                  "<|start_header_id|>assistant<|end_header_id|>\n\n"}[name]


@pytest.mark.parametrize("name", ["qwen3", "qwen3-thinking-2507"])
def test_qwen3_with_thinking_on_continues_the_sampled_reasoning(tiny, caplog, name):
    """Qwen3's last turn carries a reasoning block the model samples itself (once refused: 'does not continue its
    generation prompt'; Qwen3-Thinking-2507's generation prompt opens it, the model writes the rest); the template
    keeps the reasoning of every turn after the last user message, so a tool episode is its rendering of the whole
    conversation, token for token."""
    tok = with_template(tiny, name)
    opened = "<think>\n" if name == "qwen3-thinking-2507" else ""  # (what the generation prompt writes of it)
    tools = [{**m, "content": m["content"].removeprefix(opened)} for m in TOOLS]
    with caplog.at_level(logging.WARNING):
        s, render, sampled = episode(tok, tools)
    assert not render.append_only and "not append-only" in caplog.text  # (it rewrites turns before a user message)
    assert render.glue == "\n"
    whole = tok.apply_chat_template([*PROMPT, *tools], tokenize=True)["input_ids"]
    assert s.prompt_ids + s.response_ids + encode(tok, render.glue) == whole
    assert [ids for role, ids in s.segments() if role == "assistant"] == sampled
    assert tok.decode(s.segments()[1][1]) == ("\n<|im_start|>user\n<tool_response>\nchecked: 2 + 3 = 5\n"
                                              f"</tool_response><|im_end|>\n<|im_start|>assistant\n{opened}")
    # a user message: the template would drop the earlier turns' reasoning; the trajectory keeps what was sampled
    conversation = [*tools[:3], {"role": "user", "content": "and 2 + 4?"}, tools[4]]
    s, render, sampled = episode(tok, conversation)
    assert tok.decode(s.segments()[3][1]) == ("\n<|im_start|>user\nand 2 + 4?<|im_end|>\n<|im_start|>assistant\n"
                                              + opened)
    assert [ids for role, ids in s.segments() if role == "assistant"] == sampled
    assert "add them" in tok.decode(s.response_ids)
    assert "add them" not in tok.apply_chat_template([*PROMPT, *conversation], tokenize=False)


def test_qwen3_with_thinking_off_reads_an_empty_block_after_every_message(tiny):
    """``enable_thinking=False``: the prompt and every environment message end with the empty block a real Qwen3
    reads before its answer; the model's turns are its answers as sampled."""
    tok = with_template(tiny, "qwen3")
    s, render, sampled = episode(tok, PLAIN, thinking=False)
    head = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    want = (head + "the sum is 5<|im_end|>\n<|im_start|>user\n<tool_response>\nchecked: 2 + 3 = 5\n</tool_response>"
            f"<|im_end|>\n<|im_start|>assistant\n{EMPTY}so 5<|im_end|>\n<|im_start|>user\n<tool_response>\nok\n"
            f"</tool_response><|im_end|>\n<|im_start|>assistant\n{EMPTY}5<|im_end|>")
    assert head.endswith(f"<|im_start|>assistant\n{EMPTY}")
    assert s.prompt_ids + s.response_ids == encode(tok, want)
    assert [ids for role, ids in s.segments() if role == "assistant"] == sampled
    # the last turn is the template's own rendering of it (earlier turns keep the block the template drops there)
    assert tok.apply_chat_template([*PROMPT, *PLAIN], tokenize=False).endswith(f"assistant\n{EMPTY}5<|im_end|>\n")
    # without the switch the messages end with the bare generation prompt (thinking on, the template's default)
    assert tok.decode(TurnRenderer(tok, tok.chat_template)(PLAIN[1])).endswith("<|im_start|>assistant\n")


def test_a_qwen3_warmup_conversation_is_the_rollouts_trajectory(tiny):
    """The conversation warm-up renders with the same switch: its ids are the rollout's episode's."""
    tok = with_template(tiny, "qwen3")
    for thinking, conversation in ((False, PLAIN), ("auto", TOOLS)):
        s, _, _ = episode(tok, conversation, thinking)
        prompt, response, mask = ConversationRenderer(tok, "auto", enable_thinking=thinking)(PROMPT, conversation)
        assert (prompt, response) == (s.prompt_ids, s.response_ids)
        assert mask == [float(m) for m in s.model_mask()]
