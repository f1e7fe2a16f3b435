"""``megarl eval``: pass@1 (and pass@k) of a model or a run's checkpoint on the held-out prompts.

``--checkpoint`` may name an HF model directory, a megatron dist checkpoint (as
``megarl/checkpoint/dist.py`` writes it), a run checkpoint ``run_dir/checkpoints/step_N/``
(whose ``policy/`` is that dist checkpoint) or a run directory (its newest step:
``checkpoint.run.newest_step_dir``). A dist checkpoint is loaded into the
trainer built from ``model.path`` and synced into the engine in memory; then the same
``rollout.evaluate.pass_rates`` the training loop uses runs, with a progress bar. The result is
written as JSON (``eval.output``; by default beside a run checkpoint, ``output_path``) and printed as a table.

A run's ``step_N/critic`` is refused before launch (``checkpoint/identity.py``: its head is a value
head, not a policy); ``step_N/reference`` is evaluated, as what it is: the frozen initial model
(``model.path``'s weights, never trained), which the result and the output say (``checkpoint_note``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path

from megarl.checkpoint.dist import load_checkpoint
from megarl.checkpoint.run import newest_step_dir
from megarl.rollout.episode_eval import examples, play_episodes
from megarl.rollout.evaluate import pass_rates
from megarl.session import build_session
from megarl.types import GenerationRequest

log = logging.getLogger(__name__)


NO_EVAL_PATH = "megarl eval needs data.eval_path (the held-out prompts) when data.path is set"
"""Why a dataset run has nothing to evaluate on: ``megarl eval`` refuses with it, ``megarl train`` says it once."""


def resolve_checkpoint(path: str | Path) -> tuple[str, Path]:
    """``('hf', dir)`` or ``('dist', dir)`` for what ``--checkpoint`` names; a clear error otherwise."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--checkpoint {path}: no such directory")
    if (p / "checkpoints").is_dir():  # a run dir: its newest step
        step = newest_step_dir(p)
        if step is None:
            raise FileNotFoundError(f"--checkpoint {path}: a run dir without a checkpoint (no step_N in "
                                    f"{p / 'checkpoints'}): it saves every train.save_every steps and at its end")
        p = step
    if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        return "hf", p
    for d in (p / "policy", p):
        if (d / "metadata.json").is_file():
            return "dist", d
    raise FileNotFoundError(f"--checkpoint {path}: not an HF model dir (config.json + *.safetensors), a megatron "
                            "dist checkpoint (metadata.json), a run checkpoint step dir (policy/) or a run dir "
                            "(checkpoints/latest)")


def output_path(cfg, kind: str, path: Path) -> Path:
    """``eval.output``; by default beside the run checkpoint evaluated (``RUN/eval_step_N.json`` for
    ``RUN/checkpoints/step_N/policy``, ``..._reference.json`` for its reference: the config's own run dir may be
    another run's) where that run dir is writable, else ``<train.run_dir>/eval.json``."""
    if cfg.eval.output:
        return Path(cfg.eval.output)
    step = path.parent if path.name in ("policy", "critic", "reference") else path
    run = step.parent.parent
    if kind == "dist" and step.parent.name == "checkpoints" and step.name.startswith("step_") and \
            os.access(run, os.W_OK | os.X_OK):
        return run / f"eval_{step.name}{'' if path.name in ('policy', step.name) else '_' + path.name}.json"
    return Path(cfg.train.run_dir) / "eval.json"


def checkpoint_note(kind: str, path: Path) -> str:
    """What the evaluated weights are, when not what the name suggests: a run's ``reference/`` (else '')."""
    if kind == "dist" and path.name == "reference" and (path.parent / "policy").is_dir():
        return (f"{path} is the run's reference model: the frozen initial model (model.path's weights, never "
                f"trained by the run); the trained policy of that step is {path.parent / 'policy'}")
    return ""


def format_table(result: dict) -> str:
    keys = [k for k in result if isinstance(result[k], (int, float, str)) and k not in ("examples", "note")]
    width = max(len(k) for k in keys)
    lines = [f"{'metric':<{width}}  value", f"{'-' * width}  -----"]
    for k in keys:
        v = result[k]
        lines.append(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    return "\n".join(lines)


def shown(s, count: int = 3) -> list[dict]:
    """The first held-out prompts' greedy responses (multi-turn: their episodes' transcripts), for the reader."""
    prompts, max_tokens = s.eval_prompts[:count], s.cfg.rollout.max_new_tokens
    requests = [GenerationRequest(p.ids, max_tokens=max_tokens, greedy=True) for p in prompts]
    if s.eval_episodes is not None:
        return examples(play_episodes(s.engines, s.eval_episodes, prompts, requests, seed=0), prompts, s.tokenizer)
    outs = s.engines.generate(requests, seed=0)
    return [{"prompt": p.text, "answer": p.answer,
             "response": s.tokenizer.decode(o[0].token_ids, skip_special_tokens=True)} for p, o in zip(prompts, outs)]


def run_eval(cfg, checkpoint: str | None = None) -> dict:
    """Build the session (engine, trainer, prompts, rewards), load the checkpoint, evaluate, write the JSON."""
    kind, path = resolve_checkpoint(checkpoint) if checkpoint else ("hf", Path(cfg.model.path))
    out = output_path(cfg, kind, path)
    if kind == "hf" and checkpoint:
        cfg = replace(cfg, model=replace(cfg.model, path=str(path), make_tiny=""))
    # the session's own files (resolved config, TensorBoard) go beside the result, not over a run's
    cfg = replace(cfg, train=replace(cfg.train, run_dir=str(out.parent / "eval_session")),
                  warmup=replace(cfg.warmup, steps=0, path=""))
    note = checkpoint_note(kind, path)
    s = build_session(cfg)
    if note and s.is_main:
        log.info(f"megarl eval: note: {note}")
    if kind == "dist":
        load_checkpoint(s.trainer, path, load_optimizer=False)
        report = s.weight_sync.run(s.engines, version=0)  # the loop's protocol: streamed, all or nothing
        if not report.loaded:
            raise RuntimeError(f"the checkpoint {path} could not be loaded into the engines (see the log above)")
    result = pass_rates(s.engines, s.tokenizer, s.eval_prompts, s.rewards, cfg.rollout.max_new_tokens,
                        cfg.eval.samples, cfg.eval.temperature, progress=s.is_main, episodes=s.eval_episodes)
    result = {"checkpoint": str(path), "kind": kind, **({"note": note} if note else {}),
              "data": cfg.data.eval_path or f"task:{cfg.data.task}", **result, "examples": shown(s)}
    s.rewards.close()
    s.close()
    if s.is_main:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(format_table(result))
        if note:
            print(f"note: {note}")
        print(f"eval written to {out.resolve()}", flush=True)
    return result
