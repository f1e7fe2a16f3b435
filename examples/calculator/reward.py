"""The reward of the calculator example: 1.0 when the model's final turn is the product, else 0.0 (the same for both
arms: a tool call is no answer, the number after it is)."""

from __future__ import annotations


def score(response: str, answer: str) -> float:
    """1.0 when ``response`` (the episode's last model turn), stripped, is the integer ``answer``."""
    return 1.0 if response.strip() == str(answer).strip() else 0.0
