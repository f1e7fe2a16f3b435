"""User reward functions the reward tests name by dotted path (``helpers.reward_fns:NAME``); they run in the pool."""

import os
import time


def hang_or_raise(response: str, answer: str, **_) -> float:
    """Sleeps forever on 'hang', raises on 'boom', dies on 'exit'; otherwise 1.0 when response == answer."""
    if response == "hang":
        time.sleep(10**6)
    if response == "boom":
        raise RuntimeError("a bad row")
    if response == "exit":
        os._exit(3)
    return 1.0 if response == answer else 0.0


def with_extras(response: str, answer: str, difficulty: int, source: str = "") -> dict:
    """A dict result that uses row extras: ``score`` plus ``difficulty`` and a ``long`` flag."""
    return {"score": float(response.strip() == answer) * (2.0 if source == "olympiad" else 1.0),
            "difficulty": difficulty, "long": float(len(response) > 10)}


def not_a_number(response: str, answer: str, **_):
    return "high"


def overlong_penalty(response: str, answer: str, finish_reason: str, **_) -> float:
    """DAPO-style shaping that needs to know whether the sample was cut at the length cap."""
    return -1.0 if finish_reason == "length" else float(response.strip() == answer)


def slow_match(response: str, answer: str, **_) -> float:
    """1.0 when the response ends with the answer, after ``SLOW_REWARD_S`` seconds (a slow verifier: a long phase)."""
    time.sleep(float(os.environ.get("SLOW_REWARD_S", "1")))
    return float(response.strip().endswith(str(answer)))


def character_variety(response: str, answer: str, **_) -> float:
    """The share of distinct characters in the response: a reward that differs between a random model's samples (so
    their advantages, the RL loss and its gradient are not zero)."""
    return len(set(response)) / max(1, len(response))
