"""Typed run configuration: dataclasses (``schema``), strict YAML loading and overrides (``loader``), and every
pre-launch check (``validate``)."""

from megarl.config.errors import ConfigError
from megarl.config.loader import load_config, parse_override, to_dict
from megarl.config.schema import RunConfig
from megarl.config.validate import validate

__all__ = ["ConfigError", "RunConfig", "load_config", "parse_override", "to_dict", "validate"]
