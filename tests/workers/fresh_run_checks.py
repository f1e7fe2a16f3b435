"""train.resume=never (or auto with nothing to resume) in a used run dir, on the real save/resume
code (``start_run_dir`` as ``build_session`` calls it, ``RunCheckpoints.save``, ``resolve_resume``)
in a 1-process gloo group: prints one JSON line.

    python tests/workers/fresh_run_checks.py RUN_DIR
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from helpers.processes import end_process_group
from megarl.checkpoint.run import RunCheckpoints, resolve_resume, start_run_dir


def save(ckpts: RunCheckpoints, step: int, tag: str) -> None:
    ckpts.save(step, lambda tmp: (tmp / "policy").mkdir() or (tmp / "policy" / "weights").write_text(tag))


def main(run: Path) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    old = RunCheckpoints(run, keep=2)
    for step in (6, 7):  # the earlier run: two checkpoints, two exports, its metrics
        save(old, step, "old")
        (run / "hf" / f"step_{step}").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 7}\n')
    (run / "config.json").write_text('{"model": {"path": "old"}}')
    (run / "tb").mkdir()
    (run / "tb" / "events.old").write_text("old")
    start_run_dir("never", run)  # build_session, before it writes the new config.json and opens the logs
    (run / "config.json").write_text('{"model": {"path": "new"}}')
    fresh = resolve_resume("never", run, 2)
    new = RunCheckpoints(run, keep=2)
    for step in (1, 2, 3):
        save(new, step, "new")
    (run / "hf" / "step_3").mkdir(parents=True)
    aside = sorted(p.name for p in run.iterdir() if p.name.startswith("previous_run_"))
    prev = run / aside[0] if aside else run
    print(json.dumps({
        "resumed": str(fresh), "aside": aside, "steps": new.steps(),
        "hf": sorted(p.name for p in (run / "hf").iterdir()),
        "prev_steps": RunCheckpoints(prev).steps(), "prev_hf": sorted(p.name for p in (prev / "hf").iterdir()),
        "prev_weights": (prev / "checkpoints" / "step_000007" / "policy" / "weights").read_text(),
        "prev_metrics": (prev / "metrics.jsonl").read_text(), "prev_config": (prev / "config.json").read_text(),
        "prev_tb": sorted(p.name for p in (prev / "tb").iterdir()), "left": sorted(p.name for p in run.iterdir()),
        "auto_nothing": str(resolve_resume("auto", run.parent / "empty_run", 2)),
    }))
    end_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
