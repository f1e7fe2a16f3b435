"""Everything besides weights that a run needs to continue as if never stopped, and where it comes from.

``state.pkl`` (rank 0; the controller and the data are the same on every rank):

- ``step``: RL steps done (also the TensorBoard / metrics.jsonl step); the LR schedule is a
  function of it (``lr_at``), the LR is kept for reference;
- ``policy_version``: weight updates made (fewer than ``step`` when a step had no useful group):
  the version the engines serve after resume and the one staleness is counted against;
- ``controller``: the SortedRL controller's ``state_dict`` — live groups with their samples
  (tokens, per-token behaviour logprobs and policy versions, statuses), re-queued prompts, the
  per-prompt length cache, released prompt indices;
- ``pipeline``: the batches generated ahead and not yet trained (``rollout.overlap``), and its counts;
- ``source``: prompts drawn so far (``IndexedSource``) and the source's own ``state_dict`` when
  it has one; ``stateful``: the data cursor of the task stream, the curriculum's pass-rate
  tracker and RNG, the reward runner's counters — each through its ``state_dict`` or, for
  today's classes without one, the fields listed in ``_FIELDS``;
- ``run``: the pass@1 before RL, fault counters, the supervised warm-up steps done and their NLL (a checkpoint
  of step 0 saved on a preemption during the warm-up: the rerun goes on at its next step, ``RunKeeper.warm_up``).

``rng/rank_NNNNN.pt`` (every rank): python's, torch's, megatron's tracker RNG states (and the GPU's). A run
resumed at another world size takes rank ``r``'s file, or rank ``r mod saved`` when it has none.
"""

from __future__ import annotations

import pickle
import random
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

# Objects of today's classes without a state_dict: the attributes that are their state.
_FIELDS = {
    "PassRateTracker": ("passed", "seen"),
}


def state_of(obj) -> object:
    """``obj.state_dict()``, or the state of today's classes without one; None (with a warning) otherwise."""
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    name = type(obj).__name__
    if name == "AdditionTask":
        return {"cursor": obj.cursor}
    if name == "CurriculumSource":
        return {"rng": obj.rng.getstate()}
    if name in _FIELDS:
        return {k: getattr(obj, k) for k in _FIELDS[name] if hasattr(obj, k)}
    warnings.warn(f"run checkpoint: a {name} has no state_dict(); a resumed run starts it afresh", stacklevel=2)
    return None


def restore(obj, state) -> None:
    if state is None:
        return
    if hasattr(obj, "load_state_dict"):
        obj.load_state_dict(state)
    elif type(obj).__name__ == "AdditionTask":
        obj.skip_to(state["cursor"])
    elif type(obj).__name__ == "CurriculumSource":
        obj.rng.setstate(state["rng"])
    else:
        for k, v in state.items():
            setattr(obj, k, v)


class IndexedSource:
    """The controller's prompt source, numbered and counted here so a resumed run goes on where it was.

    Prompt indices are the draw count (as today's sources number them); ``recent`` keeps the items
    drawn since ``mark()`` (engine-fault recovery re-queues them). A source with ``state_dict`` is
    restored through it; one without is replayed ``drawn`` times from its seed (the objects whose
    state the draws depend on — task stream, curriculum — are restored after the replay).
    """

    def __init__(self, inner) -> None:
        self.inner, self.drawn, self.recent = inner, 0, []

    def __call__(self):
        item = self.inner()
        if item is None:
            return None
        item.index = self.drawn
        self.drawn += 1
        self.recent.append(item)
        return item

    def mark(self) -> None:
        self.recent = []

    def state_dict(self) -> dict:
        own = self.inner.state_dict() if hasattr(self.inner, "state_dict") else None
        return {"drawn": self.drawn, "inner": own}

    def load_state_dict(self, state: dict) -> None:
        if state["inner"] is not None:
            self.inner.load_state_dict(state["inner"])
        else:
            for _ in range(state["drawn"]):
                self.inner()
        self.drawn, self.recent = state["drawn"], []


def rollout_state(controller, pipeline) -> dict:
    """What a checkpoint keeps of the rollout: the controller's state (a copy), the batches generated ahead and the
    prompts drawn, in one hold of the state lock that the controller and the pipeline share. Taken inside
    ``Pipeline.pause`` (or ``hold``), it is consistent by construction: each of them changes only inside an engine
    step or under that lock (``rollout/pipeline.py``, invariant 3), so every prompt drawn is in exactly one place."""
    if controller.lock is not pipeline.lock:
        raise ValueError("the controller and the pipeline must share one state lock "
                         "(RolloutController(..., lock=pipeline.lock)): a checkpoint could miss a batch otherwise")
    with controller.lock:
        return {"controller": pickle.loads(controller.snapshot()),  # (a copy: a group may still be being scored)
                "pipeline": pipeline.state_dict(), "source": controller.next_prompt.state_dict()}


def capture(s, step: int, run: dict) -> dict:
    """The run's state after ``step`` RL steps (rank 0 writes it)."""
    return {
        "step": step,
        "policy_version": s.policy_version,
        "lr": s.trainer.optimizer.param_groups[0]["lr"],
        **rollout_state(s.controller, s.pipeline),  # controller, pipeline (batches generated ahead), source
        "stateful": {name: state_of(obj) for name, obj in stateful(s).items()},
        "run": dict(run),
    }


def stateful(s) -> dict:
    """The session's objects whose state a checkpoint keeps, besides controller and source (no task: a dataset)."""
    out = {name: obj for name, obj in (("task", s.task), ("rewards", s.rewards)) if obj is not None}
    out.update(getattr(s, "stateful", {}) or {})
    return out


def apply(s, state: dict) -> None:
    """Put a captured state back into a freshly built session (source replay first, then the rest)."""
    s.controller.next_prompt.load_state_dict(state["source"])
    s.controller.load_state_dict(state["controller"])
    if "pipeline" in state:
        s.pipeline.load_state_dict(state["pipeline"])
    s.policy_version = state.get("policy_version", state["step"])  # (checkpoints before it: one update a step)
    objs = stateful(s)
    for name, value in state["stateful"].items():
        if name in objs:
            restore(objs[name], value)


def buffer_digest(controller_state: dict) -> str:
    """A short hash of the partial buffer (live groups: indices, tokens, behaviour logprobs, versions,
    statuses), independent of dict order; a resumed run prints it so tests can compare it to the saved one."""
    import hashlib

    rows = sorted((i, j, tuple(x.response_ids), tuple(x.logprobs), tuple(x.versions), x.status.value)
                  for i, (_, samples, *_rest) in controller_state["live"].items() for j, x in enumerate(samples))
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]


def rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():  # the GPU's default generator (megatron's dropout outside the tracker's regions)
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _size(state) -> int | None:
    """A generator state's size in bytes (None: a graph-safe ``torch.Generator``, not a tensor)."""
    return state.numel() if isinstance(state, torch.Tensor) else None


def set_rng_state(state: dict) -> None:
    """Put ``rng_state`` back. The tracker's streams (dropout) only where they are of this device's kind: a CPU
    generator's state (5,056 bytes, the streams of a run on CPU) cannot seed a GPU's Philox one (16 bytes) or the
    other way round; a run resumed on the other kind keeps the streams seeded from ``train.seed``, said once."""
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    now, saved = tracker.get_states(), state["tracker"]
    if all(name in now and _size(now[name]) == _size(t) for name, t in saved.items()):
        tracker.set_states(saved)
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
    else:
        warnings.warn("run checkpoint: its dropout RNG streams were written on another kind of device (CPU and GPU "
                      "generators differ); they start again from train.seed (dropout is not bit-exact across the "
                      "resume, everything else is restored)", stacklevel=2)


def write_state(root: Path, state: dict | None) -> None:
    """Every rank: its RNG file; rank 0 also ``state.pkl``."""
    rank = dist.get_rank()
    (root / "rng").mkdir(exist_ok=True)
    torch.save(rng_state(), root / "rng" / f"rank_{rank:05d}.pt")
    if rank == 0:
        (root / "state.pkl").write_bytes(pickle.dumps(state))


def read_state(root: Path) -> dict:
    """``state.pkl``, and this rank's RNG states put back."""
    rank = dist.get_rank()
    files = sorted((root / "rng").glob("rank_*.pt"))
    mine = root / "rng" / f"rank_{rank:05d}.pt"
    set_rng_state(torch.load(mine if mine.is_file() else files[rank % len(files)], weights_only=False))
    return pickle.loads((root / "state.pkl").read_bytes())
