"""The house stays in order: every unit of ``megarl/`` (a package, or a top-level module) imports only units below
it in ``LAYERS``, so the package import graph has no cycle; an import made inside a function says why it is
deferred (start-up cost), since one made there to dodge a cycle is what this test exists to prevent.
``docs/architecture.md`` draws the same order. And each room keeps what is its own: only ``engines/`` asks what kind
of engine it holds, only ``distributed/`` and ``compat/`` reach megatron's parallel globals, only ``testing/``
reads the test hooks' environment."""

from __future__ import annotations

import ast
import re
from pathlib import Path

MEGARL = Path(__file__).resolve().parents[2] / "megarl"

LAYERS = ["types", "data", "models", "distributed", "compat", "rewards", "envs", "checkpoint", "logging", "config",
          "algo", "launch", "trainer", "weight_sync", "engines", "rollout", "convert", "testing", "faults", "session",
          "keeper", "evaluation", "train", "cli"]
"""Bottom to top: a unit may import the units before it, never one after it."""


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "megarl" or len(parts) < 2:
        return None
    return parts[1]


def _imports() -> list[tuple[Path, int, str, str, bool, str]]:
    """(file, line, importing unit, imported unit, inside a function, the source line) for every megarl import."""
    out = []
    for path in sorted(MEGARL.rglob("*.py")):
        rel = path.relative_to(MEGARL)
        unit = rel.parts[0].removesuffix(".py")
        lines = path.read_text().splitlines()
        tree = ast.parse(path.read_text())
        inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)}
        package = ".".join(("megarl", *rel.with_suffix("").parts[:-1]))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against this file's package
                    base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], base]).strip(".")
                targets = [f"{base}.{a.name}" if base == "megarl" else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                if (other := _unit(target)) is not None and other != unit:
                    text = " ".join(lines[node.lineno - 1:node.end_lineno])
                    out.append((rel, node.lineno, unit, other, id(node) in inner, text))
    return out


def test_every_unit_is_in_a_layer():
    units = {p.name.removesuffix(".py") for p in MEGARL.iterdir()
             if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()}
    assert units == set(LAYERS), f"missing from LAYERS: {units - set(LAYERS)}; gone: {set(LAYERS) - units}"


def test_units_import_only_the_layers_below_them():
    imports = _imports()
    upward = [f"{f}:{line}: {unit} imports {other} ({text.strip()})" for f, line, unit, other, _, text in imports
              if unit != "__init__" and LAYERS.index(other) > LAYERS.index(unit)]
    assert not upward, "imports against the layering (a cycle in the making):\n" + "\n".join(upward)
    # megarl/__init__ runs before any unit: it installs compat's import hook (megatron without the compiler), no more
    assert [text.split("#")[0].strip() for _, _, unit, _, _, text in imports if unit == "__init__"] == [
        "from megarl.compat import lazy_compile as _lazy_compile"]


def test_imports_inside_functions_say_why_they_are_deferred():
    unsaid = [f"{f}:{line}: {text.strip()}" for f, line, _, _, inner, text in _imports()
              if inner and "deferred:" not in text]
    assert not unsaid, "megarl imports inside functions without a '# deferred: why' comment:\n" + "\n".join(unsaid)


def test_the_check_itself_sees_an_upward_import():
    """A deliberately wrong edge is caught (the scan reads relative and ``from megarl import x`` forms too)."""
    found = {(unit, other) for _, _, unit, other, _, _ in _imports()}
    assert ("weight_sync", "distributed") in found
    assert ("session", "rollout") in found and LAYERS.index("rollout") < LAYERS.index("session")


def _sources(outside: str) -> list[tuple[Path, int, str]]:
    """(file, line number, line) of every line of ``megarl/`` outside the unit ``outside``."""
    return [(path.relative_to(MEGARL), n, line) for path in sorted(MEGARL.rglob("*.py"))
            if path.relative_to(MEGARL).parts[0].removesuffix(".py") not in outside.split()
            for n, line in enumerate(path.read_text().splitlines(), 1)]


def test_only_engines_ask_what_kind_of_engine_they_hold():
    """The rest of the code holds ``engines.protocol.Engines`` and calls it; no ``hasattr`` probing of an engine."""
    probing = re.compile(r"hasattr\(\s*[\w.]*engine")
    found = [f"{f}:{n}: {line.strip()}" for f, n, line in _sources("engines") if probing.search(line)]
    assert not found, "hasattr on an engine outside engines/:\n" + "\n".join(found)


def test_only_distributed_and_compat_reach_megatron_parallel_globals():
    """``ParallelState`` carries the process groups; megatron's ``parallel_state`` module is read where it is built."""
    found = [f"{f}:{n}: {line.strip()}" for f, n, line in _sources("distributed compat")
             if re.search(r"megatron\.core(\.| import )parallel_state|import parallel_state", line)]
    assert not found, "megatron.core.parallel_state outside distributed/ and compat/:\n" + "\n".join(found)


def test_only_testing_reads_the_test_hooks():
    """Faults are injected by wrappers ``testing/`` installs; product code names no ``MEGARL_TEST_`` variable."""
    found = [f"{f}:{n}: {line.strip()}" for f, n, line in _sources("testing") if "MEGARL_TEST_" in line]
    assert not found, "MEGARL_TEST_ outside testing/:\n" + "\n".join(found)


def test_the_room_checks_see_a_violation(tmp_path):
    """Each room check fails on a line that breaks its rule (so an empty result means something)."""
    global MEGARL
    fake = tmp_path / "megarl"
    (fake / "rollout").mkdir(parents=True)
    (fake / "rollout" / "bad.py").write_text("from megatron.core import parallel_state as mpu\n"
                                             "ok = hasattr(self.engine, 'clients')\nx = 'MEGARL_TEST_FAULT'\n")
    checks = (test_only_engines_ask_what_kind_of_engine_they_hold,
              test_only_distributed_and_compat_reach_megatron_parallel_globals, test_only_testing_reads_the_test_hooks)
    MEGARL, saved = fake, MEGARL
    try:
        for check in checks:
            try:
                check()
            except AssertionError:
                continue
            raise AssertionError(f"{check.__name__} passed on a file that breaks its rule")
    finally:
        MEGARL = saved
