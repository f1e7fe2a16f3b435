"""What the controller expects of a prompt's trajectories, and of a sample's rest: model tokens, turns, tool time.

A multi-turn trajectory's cost is not one response length: its model turns, and between them the environment's
answers, during which the sample holds no engine slot yet its group cannot complete. The controller learns per prompt
(``PromptBuffer``'s caches, from each released group) the mean model tokens of a trajectory (``length_cache``), its
mean model turns (``turns_cache``) and the seconds its environment calls took (``env_cache``), and per run the
slot-seconds one sampled token costs (``token_s``, from the last phase that generated). A sample's expected rest,
in tokens::

    remaining = max(L - model tokens so far, 0)  +  E · max(T - answered calls, 0) / T  /  token_s
                 (the model's turns still to come)    (its environment's time still to come, as tokens a slot
                                                       could have sampled meanwhile)

with L, T, E the prompt's means (L at least what a discarded sample of it reached). A group's is its slowest
sample's. Single-turn (T = 1, E = 0) it is the remaining length, as before. Pure Python.
"""

from __future__ import annotations

from megarl.types import Sample


def remaining(s: Sample, tokens: float, turns: float, env_s: float, token_s: float) -> float:
    """Sample ``s``'s expected rest in tokens (see the module docstring): ``tokens``, ``turns``, ``env_s``: its
    prompt's mean model tokens, model turns and environment seconds per trajectory; ``token_s``: slot-seconds per
    sampled token (0: unknown, the environment's time is left out)."""
    rest = max(tokens - s.model_tokens, 0.0)
    if env_s > 0 and token_s > 0 and turns > 0:
        answered = len(s.env_messages)  # (a call in flight is still to come)
        rest += env_s * max(turns - answered, 0.0) / turns / token_s
    return rest
