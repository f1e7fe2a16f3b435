"""Run checkpoints on disk: atomic, versioned, verified, pruned.

Layout (``megarl eval --checkpoint`` reads ``latest`` → ``step_N/policy/``)::

    run_dir/checkpoints/
        latest                    'step_000120' — written last (temporary name, fsync, rename)
        step_000120/
            policy/  critic/  reference/   megatron dist checkpoints (model + optimizer, dist.py)
            state.pkl             the run's state (rank 0): step, controller with its partial buffer,
                                  data cursor, rewards, trackers, fault counters (see session_state.py)
            rng/rank_00000.pt     each rank's RNG states (python, torch, megatron's tracker)
            manifest.json         size of every file above, sha256 of those ≤ 64 MiB — written last

A step directory is written as ``step_000120.tmp``, every file fsynced, the manifest written, then
renamed; only then does ``latest`` move. A crash at any point leaves the previous checkpoint and
``latest`` intact (a stale ``*.tmp`` is removed by the next save). On resume the newest checkpoint
is verified against its manifest; a missing manifest or a file of the wrong size or hash makes it
unusable, and the previous one is used with a warning that names the problem.

A fresh run (``train.resume=never``, or ``auto`` with nothing to resume) in a directory an earlier
run used first moves that run's ``checkpoints/`` and ``hf/`` (with ``never``, before the new run
writes anything, its ``config.json``, ``metrics.jsonl`` and ``tb/`` too: ``start_run_dir``; with
``auto``, a copy of its ``metrics.jsonl``) to ``run_dir/previous_run_<UTC time>/``: nothing of it
is rotated away or mixed with the new run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path

import torch.distributed as dist

log = logging.getLogger(__name__)

HASH_LIMIT = 64 << 20  # files up to this size are hashed; larger ones (weights of big models) checked by size
_STEP = re.compile(r"^step_(\d+)$")


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` or its old content, never a part: temporary name, fsync, rename, fsync dir."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != "manifest.json")


def write_manifest(root: Path) -> None:
    """fsync every file under ``root``, then record sizes (and small files' hashes) in manifest.json."""
    entries = {}
    for p in _files(root):
        _fsync(p)
        size = p.stat().st_size
        entries[str(p.relative_to(root))] = {"size": size, **({"sha256": _sha256(p)} if size <= HASH_LIMIT else {})}
    for d in sorted({p.parent for p in _files(root)} | {root}):
        _fsync(d)
    write_atomic(root / "manifest.json", json.dumps({"files": entries}, indent=1).encode())


def verify(root: Path) -> str:
    """'' when ``root`` matches its manifest, else what is wrong with it."""
    manifest = root / "manifest.json"
    if not manifest.is_file():
        return f"{manifest} is missing (the save did not finish)"
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as exc:
        return f"{manifest} is unreadable ({exc})"
    for rel, want in entries.items():
        p = root / rel
        if not p.is_file():
            return f"{p} is missing"
        size = p.stat().st_size
        if size != want["size"]:
            return f"{p} has {size} bytes, the manifest says {want['size']} (truncated?)"
        if "sha256" in want and _sha256(p) != want["sha256"]:
            return f"{p} does not match its sha256 in the manifest (corrupted)"
    return ""


class RunCheckpoints:
    """The checkpoints of one run directory: save (all ranks), find the one to resume, prune."""

    def __init__(self, run_dir: str | Path, keep: int = 2) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def steps(self) -> list[int]:
        """Steps of the complete-looking (renamed) checkpoints, newest first."""
        return sorted(_step_dirs(self.root), reverse=True)

    def save(self, step: int, write) -> Path:
        """Write checkpoint ``step``: ``write(tmp_dir)`` fills it on every rank; rank 0 seals and publishes it."""
        rank = dist.get_rank()
        final = self.root / step_name(step)
        tmp = final.with_name(final.name + ".tmp")
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*.tmp"):  # a save that died half-way
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
            tmp.mkdir()
        dist.barrier()
        write(tmp)
        dist.barrier()
        if rank == 0:
            write_manifest(tmp)
            if final.exists():  # the same step saved again (a resumed run that ends where it resumed)
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync(self.root)
            write_atomic(self.root / "latest", (final.name + "\n").encode())
            self._prune(step)
        dist.barrier()
        return final

    def _prune(self, newest: int) -> None:
        for old in self.steps()[self.keep:]:
            if old != newest:
                shutil.rmtree(self.root / step_name(old), ignore_errors=True)

    def latest(self) -> Path | None:
        """The newest checkpoint that verifies (rank 0 only), warning about each newer one that does not."""
        named = []
        pointer = self.root / "latest"
        if pointer.is_file():
            m = _STEP.match(pointer.read_text().strip())
            if m:
                named = [int(m.group(1))]
        for step in named + [s for s in self.steps() if s not in named]:
            path = self.root / step_name(step)
            problem = verify(path) if path.is_dir() else f"{path} does not exist ('latest' names it)"
            if not problem:
                return path
            warnings.warn(f"checkpoint {path} is unusable: {problem}; trying the previous one", stacklevel=2)
            log.info(f"warning: checkpoint {path} is unusable: {problem}; trying the previous one")
        return None


def step_dir_problem(path: str | Path) -> str:
    """'' when ``path`` looks like a run checkpoint step dir (``run_dir/checkpoints/step_N`` with
    ``policy/``), else what it is instead and what to pass (``train.resume=PATH`` before launch)."""
    p = Path(path)
    want = "expected a run checkpoint step dir (run_dir/checkpoints/step_N, holding policy/ and manifest.json)"
    if not p.is_dir():
        return f"{want}; {p} is not a directory"
    if (p.name in ("policy", "critic", "reference") and (p / "metadata.json").is_file()
            and (p.parent / "policy").is_dir()):
        return f"expected a run checkpoint step dir ({p.parent}), got its {p.name}/ subdir"
    if (p / "checkpoints").is_dir():
        steps = RunCheckpoints(p).steps()
        newest = f"{p / 'checkpoints' / step_name(steps[0])}" if steps else "run_dir/checkpoints/step_N"
        return (f"{want}, got a run dir; pass {newest}, or train.run_dir={p} train.resume=auto "
                "to continue that run")
    if (p / "metadata.json").is_file():
        return (f"{want}; {p} is a megatron dist checkpoint of the weights alone (no run state): convert it "
                "(tools/convert_checkpoint.py mcore-to-hf) and start from it with model.path")
    if not (p / "policy").is_dir():
        return f"{want}; {p} has no policy/ subdir"
    return ""


def resume_candidate(resume: str, run_dir: str | Path) -> Path | None:
    """The step dir ``train.resume`` would continue from, looked up without verifying (for checks
    before launch): the path itself, or for 'auto' ``newest_step_dir``."""
    if resume == "never":
        return None
    if resume != "auto":
        return Path(resume)
    return newest_step_dir(run_dir)


def newest_step_dir(run_dir: str | Path) -> Path | None:
    """The step dir a run dir's ``checkpoints/latest`` names, else its newest ``step_N``; None when it has none.
    Looked up without verifying (a resume verifies: ``RunCheckpoints.latest``); what ``megarl eval --checkpoint``,
    the converters and ``train.resume=auto``'s checks take a run dir to mean."""
    root = Path(run_dir) / "checkpoints"
    named = (root / "latest").read_text().strip() if (root / "latest").is_file() else ""
    if _STEP.match(named) and (root / named).is_dir():
        return root / named
    found = _step_dirs(root)
    return found[max(found)] if found else None


def _step_dirs(root: Path) -> dict[int, Path]:
    """``root``'s renamed checkpoint directories (``step_N``, however N is padded) by step."""
    if not root.is_dir():
        return {}
    return {int(m.group(1)): d for d in root.iterdir() if d.is_dir() and (m := _STEP.match(d.name))}


SET_ASIDE = ("checkpoints", "hf")
"""What an earlier run left in a run dir that a fresh run would mix with its own (rotation, exports)."""


def set_aside_previous_run(run_dir: str | Path, before_logging: bool = False) -> Path | None:
    """A fresh run in a directory an earlier run used: move that run's ``checkpoints/`` and ``hf/``
    (and a copy of its ``metrics.jsonl``, which the new run empties) to ``run_dir/previous_run_<UTC time>/``,
    so that nothing of it is rotated away or taken for the new run's. ``before_logging`` (the new run
    has not yet written its ``config.json`` nor opened ``metrics.jsonl`` and ``tb/``): those move too.
    Returns that directory, or None."""
    import time

    run_dir = Path(run_dir)
    found = [run_dir / name for name in SET_ASIDE if (run_dir / name).is_dir() and any((run_dir / name).iterdir())]
    metrics = run_dir / "metrics.jsonl"
    if not found and not (metrics.is_file() and metrics.stat().st_size):
        return None
    dest = run_dir / time.strftime("previous_run_%Y%m%d-%H%M%S", time.gmtime())
    while dest.exists():
        dest = dest.with_name(dest.name + "_")
    dest.mkdir()
    if before_logging:
        found += [p for p in (run_dir / "config.json", run_dir / "tb", metrics) if p.exists()]
    for path in found:
        os.replace(path, dest / path.name)
    if metrics.is_file() and metrics.stat().st_size:
        shutil.copy2(metrics, dest / metrics.name)
    _fsync(run_dir)
    return dest


def start_run_dir(resume: str, run_dir: str | Path) -> None:
    """Rank 0, before a run writes its ``config.json`` and opens its logs: with ``train.resume=never``
    the earlier run's files, its config, metrics and TensorBoard events included, are set aside
    (``set_aside_previous_run``), and the log says where."""
    if resume == "never":
        _say_set_aside(resume, run_dir, set_aside_previous_run(run_dir, before_logging=True))


def _say_set_aside(resume: str, run_dir: str | Path, moved: Path | None) -> None:
    if moved is not None:
        log.info(f"train.resume={resume}: starting fresh in {run_dir}; the earlier run's "
                 f"{', '.join(p.name for p in sorted(moved.iterdir()))} set aside in {moved}")


def resolve_resume(resume: str, run_dir: str | Path, keep: int) -> Path | None:
    """The checkpoint this run continues from (every rank gets rank 0's answer), or None to start fresh.

    ``resume``: 'never' → None; 'auto' → the newest good one in ``run_dir`` (None when there is none);
    a path → that checkpoint, which must verify.
    """
    answer: list = [None, ""]  # (path, error): rank 0 decides, every rank raises the same error
    if dist.get_rank() == 0:
        if resume == "auto":
            ckpts = RunCheckpoints(run_dir, keep)
            answer[0] = ckpts.latest()
            if answer[0] is None and ckpts.steps():
                answer[1] = (f"train.resume=auto: no checkpoint in {ckpts.root} verifies (see the warnings); "
                             "remove them or set train.resume=never to start fresh")
        elif resume != "never":
            problem = step_dir_problem(resume) or verify(Path(resume))
            answer = [None, f"train.resume={resume}: {problem}"] if problem else [Path(resume), ""]
        if answer[0] is None and not answer[1] and resume in ("auto", "never"):
            # a fresh run: the earlier one's files are kept, apart (with never: done already, start_run_dir)
            _say_set_aside(resume, run_dir, set_aside_previous_run(run_dir))
    dist.broadcast_object_list(answer, src=0)
    if answer[1]:
        raise RuntimeError(answer[1])
    return None if answer[0] is None else Path(answer[0])
