"""Every shell command the README and the docs show runs as written, checked as far as it is cheap to check: the
fenced ``bash`` blocks of README.md, docs/*.md, bench/README.md and tests/README.md are read, and each command is

- ``make T``: a target of the Makefile;
- ``megarl train|demo|eval ...``: parsed by the CLI and its config loaded with the overrides (keys, types,
  choices; nothing launched);
- ``megarl plan ...`` and ``PLAN_ONLY=1 examples/*.sh ...``: run, and must exit 0 (the documented layout fits);
- ``python SCRIPT ...`` (tools/, bench/, examples/): ``SCRIPT --help`` exits 0 and names every ``--flag`` used;
- ``python -m pytest ...``: collects at least one test;
- ``examples/*.sh`` and ``slurm/*.sbatch``: parse (``bash -n``) and ``--help`` where they have one.

A command of another kind fails the test, so new docs cannot slip past it unread."""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers.scripts import ROOT, worker_env

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md",
         ROOT / "tests" / "README.md"]
ENV = re.compile(r"^[A-Z][A-Z0-9_]*=")


def _commands() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    out.append((page.relative_to(ROOT).as_posix(), re.sub(r"\s+#.*$", "", line)))
    return out


COMMANDS = _commands()


def _split(command: str) -> tuple[dict, list[str]]:
    words = shlex.split(command)
    env = {}
    while words and ENV.match(words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


@functools.cache
def _help(script: str, sub: str = "") -> str:
    proc = subprocess.run([sys.executable, script, *([sub] if sub else []), "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env=worker_env())
    assert proc.returncode == 0, f"{script} {sub} --help failed:\n{proc.stderr[-2000:]}"
    return proc.stdout


@functools.cache
def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def _check(command: str) -> None:
    env, words = _split(command)
    prog, args = words[0], words[1:]
    if prog == "make":
        assert set(args) <= _make_targets(), f"not a Makefile target: {set(args) - _make_targets()}"
    elif prog.endswith("bin/megarl") and args[:1] == ["plan"]:
        if "--help" in args:
            return
        proc = subprocess.run([sys.executable, "-m", "megarl.cli", *args], capture_output=True, text=True, cwd=ROOT,
                              timeout=300, env=worker_env())
        assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
    elif prog.endswith("bin/megarl"):
        from megarl.cli import parse
        from megarl.config import load_config

        if "--help" in args:
            return
        parsed = parse(args)
        load_config(parsed.config, parsed.overrides)
    elif prog.startswith("examples/") and prog.endswith(".sh"):
        assert subprocess.run(["bash", "-n", prog], cwd=ROOT).returncode == 0
        run = ["bash", prog, *args] if env.get("PLAN_ONLY") == "1" else ["bash", prog, "--help"]
        proc = subprocess.run(run, capture_output=True, text=True, cwd=ROOT, timeout=300,
                              env={**worker_env(), **env, "PYTHON": sys.executable})
        assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
    elif prog == "sbatch":
        script = next(a for a in args if a.endswith(".sbatch"))
        assert subprocess.run(["bash", "-n", script], cwd=ROOT).returncode == 0
    elif prog.endswith("bin/python") and args[:2] == ["-m", "pytest"]:
        _check_pytest(args[2:])
    elif prog.endswith("bin/python"):
        script, *rest = args
        assert (ROOT / script).is_file(), f"{script}: no such file"
        sub = rest[0] if rest and re.fullmatch(r"[a-z][a-z0-9-]*", rest[0]) and rest[0] in _help(script) else ""
        text = _help(script, sub)  # (a subcommand's flags are in its own help)
        flags = {a.split("=")[0] for a in rest if a.startswith("--")}
        missing = {f for f in flags if f not in text}
        assert not missing, f"{script} --help does not know {missing}"
    else:
        raise AssertionError(f"no check for this kind of command: {command}")


def _check_pytest(args: list[str]) -> None:
    """``pytest`` options read statically (collecting the suite takes seconds per command): the markers of ``-m``
    are registered, each path exists, and ``-k`` names a test module or function that exists."""
    from conftest import FOLDERS

    markers = {*FOLDERS, "slow"}
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-m", "-k"):
            value, i = args[i + 1], i + 2
            words = set(re.findall(r"[A-Za-z_][\w]*", value)) - {"and", "or", "not"}
            if a == "-m":
                assert words <= markers, f"-m {value!r}: unknown markers {words - markers}"
            else:
                names = {p.stem for p in (ROOT / "tests").rglob("test_*.py")} | set(
                    re.findall(r"^def (test_\w+)",
                               "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py")), re.M))
                assert all(any(w in n for n in names) for w in words), f"-k {value!r} names no test"
            continue
        if not a.startswith("-"):
            assert (ROOT / a.split("::")[0]).exists(), f"{a}: no such test path"
        i += 1


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 50 and any(c.startswith("make demo") for _, c in COMMANDS)


@pytest.mark.parametrize("page, command", COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_a_documented_command_runs_as_written(page, command, monkeypatch):
    monkeypatch.chdir(ROOT)
    _check(command)


def test_the_check_refuses_what_would_not_run():
    """A misspelt key, an unknown script flag, a layout that does not fit: each fails the check."""
    with pytest.raises(Exception, match="rollout.prompt_per_step"):
        _check(".venv/bin/megarl train --config configs/demo.yaml rollout.prompt_per_step=4")
    with pytest.raises(AssertionError, match="--no-such-flag"):
        _check(".venv/bin/python tools/simulate_rollout.py --no-such-flag 3")
    with pytest.raises(AssertionError, match="exit 1"):
        _check("PLAN_ONLY=1 examples/qwen3-30b-a3b.sh parallel.ep=8 engine.kv_cache_gib=30")
    assert os.path.isfile(ROOT / "Makefile")
