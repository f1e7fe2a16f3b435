"""``env.*``: the values, the combinations multi-turn episodes support so far, and (before launch) the class."""

from __future__ import annotations

from megarl.config.errors import ConfigError
from megarl.config.schema import RunConfig
from megarl.envs.base import check_env_call

UNSUPPORTED = "; multi-turn episodes run with one trainer process for now (docs/environments.md)"


def validate_env(cfg: RunConfig, world_size: int) -> None:
    """``env.*`` ranges, and what does not work with environments yet (several trainer processes), refused."""
    e = cfg.env
    if not e.fn:
        return
    if ":" not in e.fn:
        raise ConfigError(f"env.fn={e.fn!r}: expected a class as 'package.module:Class'")
    if e.max_turns < 1:
        raise ConfigError(f"env.max_turns must be >= 1 (model turns per episode), got {e.max_turns}")
    if e.timeout_s <= 0 or e.workers < 1:
        raise ConfigError(f"env.timeout_s must be > 0 and env.workers >= 1, got {e.timeout_s} and {e.workers}")
    if world_size > 1:
        raise ConfigError(f"env.fn={e.fn!r} with {world_size} trainer processes: environment answers arrive at "
                          f"times no two ranks share; run one trainer process{UNSUPPORTED}")


def check_env(cfg: RunConfig, extras: dict[str, dict]) -> None:
    """``env.fn`` imports as its workers will import it and is built from each set's row columns (``extras``: the
    first usable row's other columns, by key; the built-in task: none); ValueError naming the data key."""
    if not cfg.env.fn:
        return
    if not cfg.data.path:
        check_env_call(cfg.env.fn, {})
    for key, columns in extras.items():
        try:
            check_env_call(cfg.env.fn, columns)
        except ValueError as exc:
            raise ValueError(f"{key}={getattr(cfg.data, key.split('.')[1])!r}: {exc}") from None
