"""docs/configuration.md's key reference is what ``megarl/config/reference.py`` generates from the schema now (a key
added without ``tools/config_reference.py --write`` fails here), and every key has the docstring it is generated
from."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing

from helpers.scripts import ROOT, worker_env
from megarl.config import reference
from megarl.config.schema import RunConfig


def test_the_page_holds_the_reference_as_generated_now():
    page = reference.PAGE.read_text()
    assert reference.generated_part(page) == reference.render(), (
        "docs/configuration.md's key reference is stale: run python tools/config_reference.py --write")


def test_every_key_has_a_docstring():
    undocumented = []
    for group in dataclasses.fields(RunConfig):
        cls = typing.get_type_hints(RunConfig)[group.name]
        docs = reference.field_docs(cls)
        undocumented += [f"{group.name}.{f.name}" for f in dataclasses.fields(cls) if not docs.get(f.name)]
    assert not undocumented, f"fields of megarl/config/schema.py without a docstring under them: {undocumented}"


def test_a_field_without_a_docstring_is_seen():
    source = 'class C:\n    a: int = 1\n    """A."""\n    b: int = 2\n    c: str = ""\n    """C."""\n'
    assert reference.field_docs(type("C", (), {}), source) == {"a": "A.", "b": "", "c": "C."}


def test_known_keys_with_their_types_and_defaults():
    keys = {k.path: k for k in reference.keys()}
    assert keys["rollout.overlap"].default == "none"
    assert keys["rollout.overlap"].type == "one of `none`, `one_step`, `async`"
    assert keys["train.trace"].default == "false" and keys["train.trace"].type == "bool"
    assert keys["model.make_tiny"].default == "''"
    assert keys["train.trace"].doc.startswith("Write run_dir/trace.json")
    assert len(keys) == sum(len(dataclasses.fields(typing.get_type_hints(RunConfig)[g.name]))
                            for g in dataclasses.fields(RunConfig))


def test_the_tool_checks_and_rewrites_a_stale_page(tmp_path):
    """A page whose reference lacks a key: ``--check`` exits 1, ``--write`` restores it, then ``--check`` exits 0."""
    page = reference.PAGE.read_text()
    stale = tmp_path / "configuration.md"
    stale.write_text("\n".join(line for line in page.splitlines() if not line.startswith("| `train.trace` |")) + "\n")
    assert stale.read_text() != page

    def tool(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "tools/config_reference.py", *args, "--page", str(stale)], cwd=ROOT,
                              capture_output=True, text=True, env=worker_env({"PYTHONPATH": str(ROOT)}), timeout=120)

    assert tool("--check").returncode == 1
    assert tool("--write").returncode == 0 and stale.read_text() == page
    assert tool("--check").returncode == 0
