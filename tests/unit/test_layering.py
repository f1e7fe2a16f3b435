"""The house stays in order: every unit of ``megarl/`` (a package, or a top-level module) imports only units below
it in ``LAYERS``, so the package import graph has no cycle; an import made inside a function says why it is
deferred (start-up cost), since one made there to dodge a cycle is what this test exists to prevent.
``docs/architecture.md`` draws the same order."""

from __future__ import annotations

import ast
from pathlib import Path

MEGARL = Path(__file__).resolve().parents[2] / "megarl"

LAYERS = ["types", "native", "data", "models", "distributed", "compat", "testing", "rewards", "checkpoint", "logging",
          "config", "algo", "launch", "trainer", "engines", "weight_sync", "rollout", "convert", "session", "keeper",
          "evaluation", "train", "cli"]
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
    upward = [f"{f}:{line}: {unit} imports {other} ({text.strip()})" for f, line, unit, other, _, text in _imports()
              if LAYERS.index(other) > LAYERS.index(unit)]
    assert not upward, "imports against the layering (a cycle in the making):\n" + "\n".join(upward)


def test_imports_inside_functions_say_why_they_are_deferred():
    unsaid = [f"{f}:{line}: {text.strip()}" for f, line, _, _, inner, text in _imports()
              if inner and "deferred:" not in text]
    assert not unsaid, "megarl imports inside functions without a '# deferred: why' comment:\n" + "\n".join(unsaid)


def test_the_check_itself_sees_an_upward_import():
    """A deliberately wrong edge is caught (the scan reads relative and ``from megarl import x`` forms too)."""
    found = {(unit, other) for _, _, unit, other, _, _ in _imports()}
    assert ("weight_sync", "native") in found  # `from megarl import native`
    assert ("session", "rollout") in found and LAYERS.index("rollout") < LAYERS.index("session")
