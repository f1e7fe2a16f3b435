"""Real ``megarl train`` runs in a process group of their own, and what a run checkpoint must hold."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time

from helpers.scripts import ROOT


def tiny_partial_run(model, run_dir, steps: int, *extra: str) -> list[str]:
    """``megarl train`` of a tiny model for ``steps`` RL steps, partial rollout, deterministic, a checkpoint every
    2 steps: the resume and overlap tests' run (``extra``: their own overrides)."""
    return [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/demo.yaml", "model.make_tiny=qwen2",
            f"model.path={model}", f"train.run_dir={run_dir}", "warmup.steps=20", "warmup.batch_size=16",
            f"train.steps={steps}", "train.save_every=2", "train.time_limit_s=0", "train.deterministic=true",
            "data.eval_size=4", "rollout.mode=partial", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
            "rollout.max_new_tokens=40", "engine.max_model_len=96", "engine.slots=16", "engine.kv_cache_gib=0.25",
            "optim.micro_batch_size=16", "data.max_digits=2", *extra]


def run_env(**extra) -> dict:
    return {"OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), **extra}


def start(args: list[str], env: dict | None = None, out=None) -> subprocess.Popen:
    """The run in its own session (process group), so that what it leaves behind can be killed with it."""
    return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=run_env(**(env or {})),
                            start_new_session=True)


def reap(proc: subprocess.Popen) -> None:
    """Kill the run's process group, as Slurm kills a job's processes: a SIGKILLed run leaves megatron's
    checkpoint-writer Manager process (and disaggregated engine replicas) orphaned otherwise."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def train(args: list[str], run_dir, env: dict | None = None, rc: int = 0, timeout: float = 900) -> str:
    """Run ``args`` to its end (exit ``rc``), logging beside ``run_dir``; its output."""
    log = run_dir.parent / f"{run_dir.name}.{time.time_ns()}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = start(args, env=env, out=f)
        try:
            code = proc.wait(timeout=timeout)
        finally:
            reap(proc)
    out = log.read_text()
    assert code == rc, f"exit {code}, expected {rc}:\n{out[-6000:]}"
    return out


def final_state(run_dir) -> dict:
    from megarl.checkpoint.run import RunCheckpoints

    ckpts = RunCheckpoints(run_dir)
    return pickle.loads((ckpts.root / f"step_{ckpts.steps()[0]:06d}" / "state.pkl").read_bytes())


def no_prompt_lost_or_twice(state: dict) -> None:
    """Every drawn prompt is in exactly one of: live (buffer), re-queued (or the long-prompt queue), released;
    the batches generated ahead and not yet trained (``rollout.overlap``) hold released ones, each once."""
    c = state["controller"]
    live, requeued, released = (set(c["live"]), [item.index for item, *_ in [*c["requeued"], *c.get("long_queue", [])]],
                                c["released"])
    everything = sorted([*live, *requeued, *released])
    assert everything == list(range(state["source"]["drawn"])), "a prompt was lost or is held twice"
    ahead = ([g.prompt_index for r in pickle.loads(state["pipeline"]["queue"]) for g in r.groups]
             if "pipeline" in state else [])
    assert len(set(ahead)) == len(ahead) and set(ahead) <= set(released), "a batch generated ahead lost or doubled"


def megarl(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``megarl ARGS`` from the repository root (its output captured), asserted to exit 0."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, f"megarl {args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def scalars(run_dir) -> dict[str, list[float]]:
    """A run's TensorBoard scalars, tag → values in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
