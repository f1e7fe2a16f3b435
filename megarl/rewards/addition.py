"""The addition task's reward under its old dotted name (``megarl.rewards.addition:exact_answer``);
the one implementation is ``builtin.addition_reward`` (``reward.fn: addition``)."""

from __future__ import annotations

from megarl.rewards.builtin import addition_reward as exact_answer

__all__ = ["exact_answer"]
