"""The calculator the tool arm's model calls (``env.tools``): plain functions whose type hints and docstring let
transformers' ``get_json_schema`` describe them to a chat template that shows tools."""

from __future__ import annotations


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return int(a) * int(b)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first term.
        b: The second term.
    """
    return int(a) + int(b)
