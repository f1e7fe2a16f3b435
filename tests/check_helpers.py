"""Helpers shared by the ``*_checks.py`` scripts that the tests run in subprocesses."""

from __future__ import annotations


def record_drawn(controller) -> set[int]:
    """Make ``controller`` note the index of every prompt it draws; return the set it fills."""
    drawn: set[int] = set()
    source = controller.next_prompt

    def counted():
        item = source()
        if item is not None:
            drawn.add(item.index)
        return item

    controller.next_prompt = counted
    return drawn
