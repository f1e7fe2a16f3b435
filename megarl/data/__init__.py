"""Prompt sources: synthetic verifiable tasks and the data cursor a checkpoint saves."""


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as the model sees a prompt or response: no special tokens added."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]
