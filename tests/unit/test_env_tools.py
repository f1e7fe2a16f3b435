"""The built-in tool environment (``env.fn: tools``): ``<tool_call>`` parsing in the Hermes / Qwen format, tools by
dotted path, and every malformed call answered with an error the model sees, in the sandboxed pool."""

import time

import pytest

from megarl.envs.base import check_env_call
from megarl.envs.pool import EnvPool
from megarl.envs.tools import ToolEnv, load_tools, parse_tool_calls

pytestmark = pytest.mark.alone  # tool calls awaited against a 10 s deadline: never beside another test (make test)

TOOLS = "helpers.envs:multiply, helpers.envs:lookup"


def test_calls_are_parsed_in_order_closed_or_not():
    text = ('I will multiply. <tool_call>\n{"name": "multiply", "arguments": {"a": 37, "b": 41}}\n</tool_call>'
            '<tool_call>{"name": "lookup", "arguments": {"key": "pi"}}')  # (the last one unclosed: cut at EOS)
    assert parse_tool_calls(text) == [{"name": "multiply", "arguments": {"a": 37, "b": 41}},
                                      {"name": "lookup", "arguments": {"key": "pi"}}]
    assert parse_tool_calls("the answer is 1517") == []


@pytest.mark.parametrize("turn,error", [
    ('<tool_call>{"name": "multiply", "arguments": {"a": 3,}}</tool_call>', "is not valid JSON"),
    ('<tool_call>["multiply", 3, 4]</tool_call>', 'a tool call is {"name": str'),
    ('<tool_call>{"name": "multiply", "arguments": [3, 4]}</tool_call>', "are not a JSON object"),
    ('<tool_call>{"name": "divide", "arguments": {"a": 3}}</tool_call>', "no tool named 'divide'; the tools are: "
                                                                          "multiply, lookup"),
    ('<tool_call>{"name": "multiply", "arguments": {"a": 3}}</tool_call>', "multiply raised TypeError"),
    ('<tool_call>{"name": "lookup", "arguments": {"key": "e"}}</tool_call>', "lookup raised KeyError"),
])
def test_a_malformed_call_is_answered_with_an_error_the_model_sees(turn, error):
    env = ToolEnv(load_tools(TOOLS))
    reply = env.step(f"let me see {turn}")
    assert reply["role"] == "tool" and reply["content"].startswith("tool error: ") and error in reply["content"]


def test_tools_run_in_the_pool_and_a_turn_without_a_call_ends_the_episode():
    pool = EnvPool("tools", workers=1, timeout_s=5, tools=TOOLS)
    try:
        turns = ['<tool_call>{"name": "multiply", "arguments": {"a": 37, "b": 41}}</tool_call>'
                 '<tool_call>{"name": "lookup", "arguments": {"key": "pi"}}</tool_call>',
                 '<tool_call>{"name": "multiply", "arguments": {"a": 3,}}</tool_call>', "so it is 1517"]
        replies = []
        for turn in turns:
            pool.submit("e", {"answer": "1517"}, turn)
            deadline, got = time.time() + 10, []
            while not got and time.time() < deadline:
                got = pool.poll(1.0)
            replies.append(got[0].message)
        assert replies[0] == {"role": "tool", "content": '1517\n{"value": 3.14159}'}
        assert replies[1]["content"].startswith("tool error: the tool call is not valid JSON")
        assert replies[2] is None and pool.errors == 0
    finally:
        pool.close()


def test_env_tools_are_checked_before_launch_naming_the_key():
    check_env_call("tools", {"answer": "1"}, TOOLS)
    with pytest.raises(ValueError, match=r"env.tools='helpers.envs:nope'.*has no callable 'nope'"):
        check_env_call("tools", {}, "helpers.envs:nope")
    with pytest.raises(ValueError, match="env.fn=tools needs env.tools"):
        check_env_call("tools", {}, " , ")
    with pytest.raises(ValueError, match="env.tools='tools.a:multiply'"):
        load_tools("tools.a:multiply")


def test_env_tools_without_the_builtin_and_the_builtin_without_tools_are_refused():
    from megarl.config.errors import ConfigError
    from megarl.config.schema import RunConfig
    from megarl.config.validate import validate

    cfg = RunConfig()
    cfg.env.fn, cfg.env.tools = "tools", TOOLS
    validate(cfg, 1)
    cfg.env.tools = ""
    with pytest.raises(ConfigError, match="env.fn=tools needs env.tools"):
        validate(cfg, 1)
    cfg.env.fn, cfg.env.tools = "helpers.envs:Countdown", TOOLS
    with pytest.raises(ConfigError, match="env.tools=.* is read by the built-in tool environment: set env.fn=tools"):
        validate(cfg, 1)


def test_the_prompts_describe_the_tools_to_the_model(tmp_path):
    """``env.fn: tools`` renders each prompt with ``apply_chat_template(tools=...)``: a template that lists tools
    (as Qwen's and Hermes' do) shows the model their names and arguments, from signatures and docstrings."""
    from types import SimpleNamespace

    from megarl.data.chat import PromptRenderer
    from megarl.envs.tools import prompt_tools
    from megarl.models.tiny import CHATML_TEMPLATE, build_tokenizer

    template = tmp_path / "tools.jinja"
    template.write_text("{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
                        "({{ t.function.parameters.properties | list | join(', ') }}){% endfor %}<|im_end|>\n"
                        "{%- endif %}" + CHATML_TEMPLATE)
    tools = prompt_tools(SimpleNamespace(fn="tools", tools=TOOLS))
    text, ids = PromptRenderer(build_tokenizer(), str(template), tools=tools)("What is 37 times 41?")
    assert text.startswith("<|im_start|>system\nTools: multiply(a, b) lookup(key)<|im_end|><|im_start|>user\n")
    assert prompt_tools(SimpleNamespace(fn="helpers.envs:Countdown", tools="")) is None
    with pytest.raises(ValueError, match="env.tools: undocumented cannot be described to the model"):
        prompt_tools(SimpleNamespace(fn="tools", tools="helpers.envs:undocumented"))


def test_megarl_train_refuses_tools_it_cannot_describe_or_import_before_launch(tmp_path):
    import json

    from megarl.config.validate.prelaunch import checked_config

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "What is 37 times 41?", "answer": "1517"}) + "\n")
    run = [f"train.run_dir={tmp_path}", f"model.path={tmp_path / 'model'}", "model.make_tiny=qwen2",
           f"data.path={data}", "reward.fn=exact", "env.fn=tools"]
    checked_config(None, [*run, f"env.tools={TOOLS}"], 1, command="train")
    with pytest.raises(ValueError, match="env.tools: undocumented cannot be described"):
        checked_config(None, [*run, "env.tools=helpers.envs:undocumented"], 1, command="train")
    with pytest.raises(ValueError, match="env.tools='helpers.envs:nope'"):
        checked_config(None, [*run, "env.tools=helpers.envs:nope"], 1, command="train")
