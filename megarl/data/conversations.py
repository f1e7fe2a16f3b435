"""Warm-up conversations (``warmup.path``): chat ``messages`` rows, trained on their assistant turns only, rendered
token for token as a rollout renders the same episode.

A row is ``{"messages": [...]}`` (a .jsonl or .parquet file, a directory or glob of them, a ``datasets`` dir, as
``data.path``): the messages before the first assistant turn are the prompt, then the episode alternates a model
turn (``assistant``) and an environment's message (``tool`` or ``user``), and ends with a model turn::

    [user: "What is 37 * 41?"]                                                    the prompt
    [assistant: '<tool_call>{"name": "multiply", "arguments": {"a": 37, "b": 41}}</tool_call>']   trained
    [tool: "1517"]                                                                masked (loss mask 0)
    [assistant: "1517"]                                                           trained

Rendering (``ConversationRenderer``) takes the rollout's own calls, so the warm-up starts RL on the tokens RL sees:
the prompt through ``PromptRenderer`` (the chat template with ``tools=`` where ``env.tools`` are described, and
``data.system_prompt``), each model turn as the text's tokens then EOS (what the model samples to end a turn), each
environment message through ``TurnRenderer`` exactly as ``rollout/turns.py`` appends an answer. A conversation of a
single assistant turn is a plain (prompt, response) pair.

``check_conversations`` reads every row before any process starts and names the file, line and message that is
wrong (``DataError``).
"""

from __future__ import annotations

from megarl.data import encode
from megarl.data.chat import PromptRenderer, TurnRenderer
from megarl.data.readers import BadRow, RowStore
from megarl.data.rows import DataError

ENV_ROLES = ("tool", "user")
"""The roles of an environment's messages (``env.fn``'s ``step`` answers)."""


def episode_of(row, where: str) -> tuple[list[dict], list[dict]]:
    """A row → (prompt messages, episode messages from the first assistant turn on); DataError naming ``where``."""
    if isinstance(row, BadRow):
        raise DataError(f"{where}: {row.why}")
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(f"{where}: a warm-up row is {{\"messages\": [{{\"role\", \"content\"}}, ...]}}, a non-empty "
                        f"list; got {row!r:.120}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: message {i} is not a {{'role': str, 'content': str}} mapping: {m!r:.120}")
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise DataError(f"{where}: no assistant message: nothing to train (roles: {', '.join(roles)})")
    first = roles.index("assistant")
    if not any(r != "system" for r in roles[:first]):
        raise DataError(f"{where}: no prompt before the first assistant message (roles: {', '.join(roles)})")
    for i in range(first, len(roles)):
        want = ("assistant",) if (i - first) % 2 == 0 else ENV_ROLES
        if roles[i] not in want:
            raise DataError(f"{where}: message {i} has role {roles[i]!r} where {' or '.join(map(repr, want))} was "
                            "expected: after the prompt an episode alternates an assistant turn and one "
                            f"environment message ({' or '.join(ENV_ROLES)}) (roles: {', '.join(roles)})")
    if roles[-1] != "assistant":
        raise DataError(f"{where}: the conversation ends with a {roles[-1]!r} message; an episode ends with the "
                        "model's (assistant) turn")
    return [dict(m) for m in messages[:first]], [dict(m) for m in messages[first:]]


def read_conversations(spec: str) -> list[tuple[str, list[dict], list[dict]]]:
    """Every row of ``spec`` as ``(where, prompt, episode)``; DataError (or FileNotFoundError) naming
    ``warmup.path``, the file, line and message at the first bad row."""
    try:
        store = RowStore(spec, "warmup.path")
    except ValueError as exc:  # (an empty dataset)
        raise DataError(str(exc)) from None
    out = []
    for i in range(len(store)):
        where, row = store.row(i)
        try:
            out.append((where, *episode_of(row, where)))
        except DataError as exc:
            raise DataError(f"warmup.path={spec!r}: {exc}") from None
    return out


def check_conversations(cfg) -> int:
    """Before launch: ``warmup.path``'s rows are usable conversations (the count), 0 when it is not set."""
    return len(read_conversations(cfg.warmup.path)) if cfg.warmup.path else 0


class ConversationRenderer:
    """A conversation → ``(prompt ids, response ids, model mask)``: the trajectory a rollout of the same episode
    builds (``rollout/turns.py``), with 1.0 on the model's tokens and 0.0 on the environment's."""

    def __init__(self, tokenizer, chat_template: str = "auto", system_prompt: str = "", tools: list | None = None,
                 enable_thinking=None) -> None:
        self.tokenizer, self.eos = tokenizer, tokenizer.eos_token_id
        self.prompt = PromptRenderer(tokenizer, chat_template, system_prompt, tools, enable_thinking)
        self.turn = TurnRenderer(tokenizer, self.prompt.template,  # (build_episodes' renderer of answers)
                                 enable_thinking=enable_thinking)

    def __call__(self, prompt: list[dict], episode: list[dict]) -> tuple[list[int], list[int], list[float]]:
        _, prompt_ids = self.prompt(prompt)
        response, mask = [], []
        for i, m in enumerate(episode):
            if i % 2 == 0:  # the model's turn: its text's tokens and the EOS that ends it
                ids, weight = [*encode(self.tokenizer, m["content"]), self.eos], 1.0
            else:  # the environment's message, as ``Episodes`` appends an answer
                ids, weight = self.turn({"role": m["role"], "content": m["content"]}), 0.0
            response += ids
            mask += [weight] * len(ids)
        return prompt_ids, response, mask
