"""Typed run configuration: dataclasses, strict YAML loading, overrides, validation."""

from megarl.config.loader import ConfigError, load_config, parse_override, to_dict, validate
from megarl.config.schema import RunConfig

__all__ = ["ConfigError", "RunConfig", "load_config", "parse_override", "to_dict", "validate"]
