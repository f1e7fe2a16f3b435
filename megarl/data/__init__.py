"""Prompt sources: synthetic verifiable tasks and the data cursor a checkpoint saves."""


def pad_id(tokenizer) -> int:
    """The id padded batch positions hold: the tokenizer's pad token, else its EOS, else 0. Llama-3 and Mistral
    tokenizers have no pad token (``pad_token_id`` None failed the first update, after a whole rollout phase); padded
    positions are masked out of every loss and come after each row's tokens, so any id serves."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(tid, int):
            return tid
    return 0


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as the model sees a prompt or response: no special tokens added."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]
