"""Every check ``megarl train``, ``eval`` and ``demo`` make before a process starts, in the order they make them:
the config and the model, the checkpoint a resume continues from, the job's shape, the data, the reward
function and the environment. ``python -m megarl.launch check`` runs the same before ``srun``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from megarl.config.errors import ConfigError
from megarl.config.loader import load_config
from megarl.config.schema import RunConfig
from megarl.config.validate.algo import algo_notes
from megarl.config.validate.layout import check_job_shape
from megarl.config.validate.limits import engine_dtype_notes, unread_keys
from megarl.config.validate.lora import check_lora_run
from megarl.config.validate.model import (
    check_resume_learners,
    check_resume_lora,
    check_resume_precision,
    check_start_checkpoint,
    model_config,
    routing_replay_notes,
    validate_resume_model,
)
from megarl.config.validate.settings import validate
from megarl.data.checks import check_data, check_run_data
from megarl.data.conversations import check_conversations
from megarl.envs.base import check_env_call
from megarl.envs.tools import prompt_tools
from megarl.models.hf_config import check_weights_format, is_dist_checkpoint, model_files_dir
from megarl.rewards.base import check_reward_call, import_reward_fn


def checked_config(config: str | None, overrides: list[str], nproc: int, per_node: int = 0, command: str = "",
                   notes: bool = True, say: Callable[[str], None] | None = None, node_gpus: int = 0) -> RunConfig:
    """The config, after every check made before a process starts (``ConfigError`` naming what is wrong).
    ``per_node``: the trainer's processes per node; ``node_gpus``: each node's GPUs when known (the replicas'
    ``engine.replica_devices`` are checked against both).
    ``notes``: say which keys set the run will not read, and stale data met by no off-policy correction (on
    stderr); ``say``: where the loader's notes go."""
    cfg = load_config(config, overrides, say=say)
    hf = model_config(cfg)
    if (Path(cfg.model.path) / "config.json").is_file():  # (a tiny model to be made writes safetensors)
        check_weights_format(cfg.model.path)  # vLLM would load a pytorch_model.bin; the trainer reads safetensors
    elif is_dist_checkpoint(cfg.model.path):
        check_start_checkpoint(cfg, hf)  # hf-to-mcore's output: the model its hf/config.json describes
    validate(cfg, nproc, hf)
    check_lora_run(cfg)  # (every command here runs engines: what the adapter sync does not serve)
    if command in ("train", "demo"):
        validate_resume_model(cfg, hf)  # the checkpoint it continues from is of model.path's model
        check_resume_learners(cfg)  # ... and holds the critic / reference the algorithm needs
        check_resume_precision(cfg)  # ... in the trainer's precision
        check_resume_lora(cfg)  # ... with the adapters lora.* describes
    if per_node and nproc % per_node == 0:  # the job's shape is known: its checks too
        check_job_shape(cfg, hf, nproc // per_node, per_node, node_gpus)
    stores = check_data(cfg.data, command != "eval")  # files, keys, bad rows (on_bad_row=error), held-out overlap
    # a usable row in a sample (prompt length, the tools' descriptions included); its columns
    extras = check_run_data(cfg, stores, prompt_tools(cfg.env), model_files_dir(cfg.model.path))
    check_reward(cfg, extras)
    check_env(cfg, extras)  # env.fn imports and is built from those columns
    check_conversations(cfg)  # warmup.path: every row a usable conversation
    if notes:  # (once every check passed: an error comes alone)
        for note in (unread_keys(cfg) + algo_notes(cfg) + engine_dtype_notes(cfg) + routing_replay_notes(cfg, hf)
                     + _tiny_model_note(cfg)):
            print(f"megarl: note: {note}", file=sys.stderr)
    return cfg


def check_reward(cfg: RunConfig, extras: dict[str, dict]) -> None:
    """``reward.fn`` imports as every rank will import it and takes the keyword arguments each set hands it
    (``extras``: the first usable row's other columns, by key; the built-in task: none)."""
    if ":" in cfg.reward.fn:  # (the working directory, then PYTHONPATH)
        try:
            import_reward_fn(cfg.reward.fn)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    against_rows(cfg, extras, lambda columns: check_reward_call(cfg.reward.fn, columns))


def check_env(cfg: RunConfig, extras: dict[str, dict]) -> None:
    """``env.fn`` imports as its workers will import it and is built from each set's row columns (as
    ``check_reward``)."""
    if cfg.env.fn:
        against_rows(cfg, extras, lambda columns: check_env_call(cfg.env.fn, columns, cfg.env.tools))


def against_rows(cfg: RunConfig, extras: dict[str, dict], check: Callable[[dict], None]) -> None:
    """``check(columns)`` with each set's first usable row's other columns (``extras``, by key; the built-in task:
    none); its ValueError names the set's key."""
    if not cfg.data.path:
        check({})
    for key, columns in extras.items():
        try:
            check(columns)
        except ValueError as exc:
            raise ValueError(f"{key}={getattr(cfg.data, key.split('.')[1])!r}: {exc}") from None


def _tiny_model_note(cfg: RunConfig) -> list[str]:
    """A typo'd path to a real model with ``make_tiny`` left from a copied config (a tiny model in the run dir, as
    the demo's and configs/tiny_cpu.yaml's, is meant)."""
    model, run = Path(cfg.model.path).absolute(), Path(cfg.train.run_dir).absolute()
    if cfg.model.make_tiny and not (model / "config.json").is_file() and run not in model.parents:
        return [f"model.path={cfg.model.path} holds no model (no config.json): model.make_tiny={cfg.model.make_tiny} "
                "makes a tiny random one there (set model.make_tiny='' to have a missing model refused)"]
    return []
