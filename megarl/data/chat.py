"""Prompt rendering: a dataset's prompt (a string or chat messages) → the token ids engine and trainer see.

With a chat template (``data.chat_template: auto`` and the tokenizer has one, or a
Jinja file) the messages go through the tokenizer's own
``apply_chat_template(messages, add_generation_prompt=True)``, exactly as a Qwen or
Llama tokenizer would render them; without one (``none``, or ``auto`` on a
tokenizer without a template) the contents are joined as plain text. ``data.enable_thinking`` true or false is
passed to the template as ``enable_thinking`` (Qwen3's reads it: false writes an empty reasoning block after the
generation prompt; a template that does not read it renders the same); 'auto' passes nothing.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from megarl.data import encode

log = logging.getLogger(__name__)


class PromptError(ValueError):
    """A prompt value that is neither a string nor a list of {role, content} messages."""


def as_messages(prompt, system_prompt: str = "") -> list[dict]:
    """A string → one user message; a message list is checked; ``system_prompt`` goes first if none is there."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PromptError("is an empty string")
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)) and prompt:
        messages = []
        for i, m in enumerate(prompt):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise PromptError(f"message {i} is not a {{'role': str, 'content': str}} mapping: {m!r:.80}")
            messages.append({"role": m["role"], "content": m["content"]})
        if not any(m["content"].strip() for m in messages if m["role"] != "system"):
            raise PromptError("has no message with content besides a system prompt (every other message is empty)")
    else:
        raise PromptError(f"must be a string or a non-empty list of chat messages, got {type(prompt).__name__} "
                          f"{prompt!r:.60}")
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def thinking_switch(enable_thinking) -> dict:
    """``data.enable_thinking`` → the keyword arguments of ``apply_chat_template`` ({} for 'auto' or None: the
    template's own default)."""
    if enable_thinking in ("auto", None):
        return {}
    if not isinstance(enable_thinking, bool):
        raise ValueError(f"data.enable_thinking must be true, false or 'auto', got {enable_thinking!r}")
    return {"enable_thinking": enable_thinking}


def load_template(tokenizer, chat_template: str) -> str | None:
    """The Jinja template to use for ``data.chat_template`` (None: plain text)."""
    if chat_template == "none":
        return None
    if chat_template == "auto":
        template = getattr(tokenizer, "chat_template", None) or None
        if template is None and tokenizer is not None:
            _say_plain_text()
        return template
    path = Path(chat_template)
    if not path.is_file():
        raise FileNotFoundError(f"data.chat_template={chat_template!r}: not 'auto', 'none' or an existing Jinja file")
    return path.read_text()


@functools.cache  # once per process
def _say_plain_text() -> None:
    log.warning("data.chat_template=auto: the tokenizer has no chat template, so prompts are plain text (chat messages "
                "joined by blank lines); give a Jinja file as data.chat_template for a chat format")


class PromptRenderer:
    """Renders prompts to ``(text, ids)``; ``ids`` are what the engine generates from and the trainer trains on."""

    def __init__(self, tokenizer, chat_template: str = "auto", system_prompt: str = "", tools: list | None = None,
                 enable_thinking=None) -> None:
        """``tools``: functions the chat template describes to the model (``apply_chat_template(tools=...)``:
        their JSON schemas from signature and docstring; the tool environment's ``env.tools``);
        ``enable_thinking``: ``data.enable_thinking`` (True, False, or 'auto'/None: not passed)."""
        self.tokenizer, self.system_prompt, self.tools = tokenizer, system_prompt, tools
        self.switches = thinking_switch(enable_thinking)
        self.template = load_template(tokenizer, chat_template)
        bos = getattr(tokenizer, "bos_token_id", None)  # BOS when the tokenizer's own encoding of a text adds one
        self.bos = bos if self.template is None and bos is not None and tokenizer("a")["input_ids"][:1] == [bos] \
            else None

    def __call__(self, prompt) -> tuple[str, list[int]]:
        messages = as_messages(prompt, self.system_prompt)
        if self.template is None:
            text = "\n\n".join(m["content"] for m in messages)
            ids = encode(self.tokenizer, text)
            if self.bos is not None and ids[:1] != [self.bos]:
                ids = [self.bos, *ids]  # as the tokenizer encodes a text (a chat template writes its own BOS): Llama
            return text, ids  # and Gemma base models saw BOS first in training, and so does vLLM's text prompt
        kwargs = dict(chat_template=self.template, add_generation_prompt=True, **self.switches,
                      **({"tools": self.tools} if self.tools else {}))
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return text, list(ids)


PROBE = [{"role": "user", "content": "u"}]
PROBE_REPLY = "a"  # (one character no template rewrites)
THINK_REPLY = "<think>\nr\n</think>\n\na"  # (a reasoning block: some templates drop it from earlier turns, and
# Qwen3's writes an empty one into a last turn that has none, where the model samples its own)
OPENED_REPLY = "r\n</think>\n\na"  # (the rest of a block the generation prompt opened: Qwen3-Thinking-2507's)


class TurnRenderer:
    """An environment's message → the tokens appended to a trajectory after the model's turn, whose sampled tokens
    stay as they are (never decoded and encoded again).

    With a chat template the message's tokens are the template's text past the conversation so far: the rendering of
    ``[..., assistant turn, message]`` with the generation prompt, less that of ``[..., assistant turn]``, less what
    the model itself sampled to close its turn (EOS: ``<|im_end|>`` in ChatML, leaving ``\\n<|im_start|>tool\\n...
    <|im_end|>\\n<|im_start|>assistant\\n``). For an append-only template (ChatML, SmolLM2's, Qwen2.5's, Llama
    3.1's) the trajectory then equals the template's rendering of the whole conversation.

    The model's turn is what it sampled, so a template whose last assistant turn carries a reasoning block is
    accepted where the model writes that block itself (Qwen3's: with thinking on, the model samples
    ``<think>...</think>`` then its content; off, ``enable_thinking=False`` ends the generation prompt after every
    message with an empty block), or its rest after a generation prompt that opens it (Qwen3-Thinking-2507's
    ``<think>\\n``). A template that is not append-only (it rewrites earlier turns once a later one
    exists: Qwen3's drops the empty block of every earlier turn, and the reasoning of turns before the last user
    message) is said at start; its messages are rendered after a lone user turn instead, and the model's earlier
    turns keep their sampled tokens. Without a template a message is its content between blank lines.
    """

    def __init__(self, tokenizer, template: str | None, eos_id: int | None = None, enable_thinking=None) -> None:
        """``enable_thinking``: ``data.enable_thinking`` as the prompts are rendered with it (True, False, or
        'auto'/None: not passed)."""
        self.tokenizer, self.template = tokenizer, template
        self.switches = thinking_switch(enable_thinking)
        if template is None:
            return
        eos = tokenizer.decode([eos_id if eos_id is not None else tokenizer.eos_token_id])
        head = self._render(PROBE, True)
        for reply in (PROBE_REPLY, THINK_REPLY, OPENED_REPLY):  # the model's turn: no reasoning block, or one
            turn = self._render(PROBE + [{"role": "assistant", "content": reply}], False)
            if turn.startswith(head + reply):
                break
        else:
            raise ValueError("data.chat_template: its assistant turn does not continue its generation prompt, with "
                             f"or without a reasoning block ({head!r} then {turn[len(head):]!r}); a multi-turn "
                             "environment (env.fn) cannot append to what the model sampled")
        close = turn[len(head) + len(reply):]  # what the template writes after an assistant message
        self.glue = close[len(eos):] if close.startswith(eos) else close  # ... less the EOS the model sampled
        self.append_only = True
        for role, reply in (("tool", PROBE_REPLY), ("user", PROBE_REPLY), ("tool", THINK_REPLY)):
            try:
                probe = self.delta(PROBE + [{"role": "assistant", "content": reply}], {"role": role, "content": "m"})
            except Exception as exc:  # noqa: BLE001  (a template that refuses the role)
                raise ValueError(f"data.chat_template cannot render a {role!r} message ({type(exc).__name__}: "
                                 f"{exc}); an environment's messages are 'tool' or 'user' turns") from None
            self.append_only &= probe is not None
        if not self.append_only:
            log.warning("data.chat_template is not append-only (it renders earlier turns differently once a later "
                        "one exists): an environment's messages are rendered after a lone user turn, and the "
                        "model's earlier turns keep their sampled tokens, so a trajectory differs from the "
                        "template's rendering of the whole conversation")

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=self.template,
                                                  add_generation_prompt=generation_prompt, **self.switches)

    def delta(self, before: list[dict], message: dict) -> str | None:
        """The template's text for ``message`` and the next generation prompt after ``before`` (None: rendering
        ``before + [message]`` changes the text of ``before``)."""
        base, full = self._render(before, False), self._render(before + [message], True)
        return full[len(base):] if full.startswith(base) else None

    def __call__(self, message: dict, conversation: list[dict] | None = None) -> list[int]:
        """The ids of ``message`` appended after a model turn that ended with EOS; ``conversation``: the messages
        so far (an append-only template's rendering may depend on them; default: a probe turn)."""
        if self.template is None:
            return encode(self.tokenizer, f"\n\n{message['content']}\n\n")
        before = conversation or PROBE + [{"role": "assistant", "content": PROBE_REPLY}]
        text = self.delta(before, message) if self.append_only else None
        if text is None:
            text = self.delta(PROBE, message)
        return encode(self.tokenizer, self.glue + text)
