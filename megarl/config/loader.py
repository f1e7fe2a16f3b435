"""Strict YAML → ``RunConfig``: unknown keys and wrong types are errors naming the key and file.

Overrides are ``a.b.c=value`` strings; the value is read as YAML (``lr=3e-4``,
``sequence_parallel=true``). A choice-valued setting (``Literal[...]`` in ``schema.py``) is checked here, by
its type, for every key alike. Everything else a run is checked for before launch is ``megarl.config.validate``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from collections.abc import Callable
from pathlib import Path

import yaml

from megarl.config.errors import ConfigError
from megarl.config.presets import apply_layers
from megarl.config.schema import RunConfig


class _Loader(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, where ``3e-4`` is a string; read it as the float it means (YAML 1.2)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"),
    list("-+0123456789."),
)


def _yaml(text: str, source: str = ""):
    """Parse ``text``; a key given twice in one mapping is an error naming ``source``, the line and the key."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _no_duplicate_keys(node, source or "YAML")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _no_duplicate_keys(node, source: str, prefix: str = "") -> None:
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _no_duplicate_keys(item, source, prefix)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key, value in node.value:
        name = str(key.value) if isinstance(key, yaml.ScalarNode) else ""
        if name and name != "<<":
            line = key.start_mark.line + 1
            if name in seen:
                raise ConfigError(f"{source} line {line}: duplicate key '{prefix}{name}' (first given on line "
                                  f"{seen[name]}); keep one")
            seen[name] = line
        _no_duplicate_keys(value, source, f"{prefix}{name}.")


def _choices(typ) -> tuple | None:
    """The valid values of a ``Literal[...]`` setting, None for any other type."""
    return typing.get_args(typ) if typing.get_origin(typ) is typing.Literal else None


def _type_ok(value, typ) -> bool:
    if (choices := _choices(typ)) is not None:
        return any(value == c and type(value) is type(c) for c in choices)
    if typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typ)


def _apply(obj, data: dict, source: str, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: '{prefix.rstrip('.') or '<top>'}' must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in data.items():
        dotted = prefix + str(key)
        if key not in names:
            raise ConfigError(f"{source}: unknown key '{dotted}'; valid keys here: {', '.join(sorted(names))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _apply(current, value, source, dotted + ".")
            continue
        typ = hints[key]
        if typ is str and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # YAML's whole number where a string is meant: engine.replica_devices=7 (one GPU)
        if not _type_ok(value, typ):
            raise ConfigError(f"{source}: {_expected(dotted, typ, value)}")
        setattr(obj, key, float(value) if typ is float else value)


def _expected(dotted: str, typ, value) -> str:
    if (choices := _choices(typ)) is not None:
        return f"{dotted} must be one of {', '.join(map(repr, choices))}; got {value!r}"
    return f"'{dotted}' must be {typ.__name__}, got {value!r} ({type(value).__name__})"


@functools.cache
def _type_hints(cls: type) -> dict:
    """A config dataclass's resolved annotations (``typing.get_type_hints`` evaluates them anew on every call:
    ``megarl plan`` validates thousands of candidate layouts)."""
    return typing.get_type_hints(cls)


def check_choices(cfg, prefix: str = "") -> None:
    """Every ``Literal[...]`` setting of ``cfg`` holds one of its values (a config built in code, not loaded:
    ``dataclasses.replace`` or attribute writes, is checked here as a loaded one is in ``_apply``)."""
    hints = _type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            check_choices(value, f"{prefix}{f.name}.")
        elif _choices(hints[f.name]) is not None and not _type_ok(value, hints[f.name]):
            raise ConfigError(_expected(prefix + f.name, hints[f.name], value))


def parse_override(text: str) -> dict:
    """``'a.b.c=value'`` → ``{'a': {'b': {'c': value}}}`` with the value parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY.PATH=VALUE, e.g. optim.lr=3e-4")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key part in {key!r}")
    try:
        value = _yaml(raw, f"override {text!r}") if raw != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({exc})") from None
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                say: Callable[[str], None] | None = None) -> RunConfig:
    """Defaults, then the YAML file, then each override in order; an ``algo.preset`` applies where it is given
    (``presets.apply_layers``: it replaces the algo keys of earlier layers, later keys win over it, and what it
    replaced is told to ``say``, when given: the process that speaks for the job)."""
    data = None
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = _yaml(path.read_text(), str(path)) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    layers = ([(data, str(path))] if data is not None else []) + [
        (parse_override(text), f"override {text!r}") for text in overrides]
    return apply_layers(RunConfig(), layers, _apply, say)


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)

