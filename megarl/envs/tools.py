"""The built-in tool environment (``env.fn: tools``): the model calls Python functions in the Hermes / Qwen format,
each call's result goes back as a tool message.

::

    model's turn:  I will compute it. <tool_call>{"name": "multiply", "arguments": {"a": 37, "b": 41}}</tool_call>
    environment:   {"role": "tool", "content": "1517"}          (one line per call, in order)
    a turn without <tool_call>: the episode ends (the model answered)

The tools are ``env.tools``, a comma-separated list of ``package.module:function``, called by their function name
with the call's ``arguments`` as keyword arguments. A call that is not valid JSON, names no or an unknown tool, has
arguments that are not an object, or whose function raises is answered with an error line the model sees (the
episode goes on), never a crash: ``tool error: ...``. A tool's result is sent as it is when a string, as JSON
otherwise.

The parsing follows vLLM's Hermes tool parser (``vllm/tool_parsers/hermes_tool_parser.py``: the same
``<tool_call>(.*?)</tool_call>|<tool_call>(.*)`` match, an unclosed last call included), which is not called
itself: it needs an OpenAI request object, and on one malformed call drops every call of the turn without a word
to the model, where a training episode wants the error said.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from megarl.rewards.base import load_dotted, on_cwd_path

CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def load_tools(spec: str) -> dict[str, Callable]:
    """``env.tools`` ('pkg.mod:fn, pkg.mod:other') → the functions by name; ValueError naming ``env.tools``."""
    tools: dict[str, Callable] = {}
    for path in (p.strip() for p in spec.split(",")):
        if not path:
            continue
        fn = on_cwd_path(load_dotted, path, "env.tools")
        name = getattr(fn, "__name__", path.split(":")[-1])
        if name in tools:
            raise ValueError(f"env.tools={spec!r}: two tools are named {name!r}")
        tools[name] = fn
    if not tools:
        raise ValueError("env.fn=tools needs env.tools: a comma-separated list of 'package.module:function'")
    return tools


def prompt_tools(e) -> list[Callable] | None:
    """The functions a run's prompts describe to the model (``env.fn: tools``: ``env.tools``; else None); each has a
    JSON schema from its signature and docstring (transformers' ``get_json_schema``), or a ValueError names it."""
    if e.fn != "tools" or not e.tools:
        return None
    from transformers.utils import get_json_schema  # (deferred: start-up cost; only a tool run needs it)

    tools = load_tools(e.tools)
    for name, fn in tools.items():
        try:
            get_json_schema(fn)
        except Exception as exc:  # noqa: BLE001  (transformers' DocstringParsingException, TypeHintParsingException)
            raise ValueError(f"env.tools: {name} cannot be described to the model: {exc}; give it type hints and a "
                             "docstring with an Args: section (a line per argument)") from None
    return list(tools.values())


def parse_tool_calls(text: str) -> list[dict | str]:
    """Each ``<tool_call>`` of a turn, in order: ``{"name", "arguments"}``, or the error the model should see."""
    out: list[dict | str] = []
    for closed, unclosed in CALL.findall(text):
        body = (closed or unclosed).strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            out.append(f"the tool call is not valid JSON ({exc.msg} at character {exc.pos}): {body[:200]}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            out.append(f'a tool call is {{"name": str, "arguments": {{...}}}}, got: {body[:200]}')
        elif not isinstance(call.get("arguments", {}), dict):
            out.append(f"the arguments of {call['name']!r} are not a JSON object: {call['arguments']!r:.200}")
        else:
            out.append({"name": call["name"], "arguments": call.get("arguments", {})})
    return out


class ToolEnv:
    """Answers each turn's tool calls with their results; a turn without one ends the episode."""

    def __init__(self, tools: dict[str, Callable], **row_extras) -> None:
        self.tools = tools

    def step(self, response: str) -> dict | None:
        calls = parse_tool_calls(response)
        if not calls:
            return None
        return {"role": "tool", "content": "\n".join(self.run(call) for call in calls)}

    def run(self, call: dict | str) -> str:
        if isinstance(call, str):
            return f"tool error: {call}"
        fn = self.tools.get(call["name"])
        if fn is None:
            return f"tool error: no tool named {call['name']!r}; the tools are: {', '.join(self.tools)}"
        try:
            result = fn(**call["arguments"])
        except Exception as exc:  # noqa: BLE001  (the model's call went wrong: it is told, the episode goes on)
            return f"tool error: {call['name']} raised {type(exc).__name__}: {exc}"[:500]
        return result if isinstance(result, str) else json.dumps(result, default=str)
