"""The base model's HF weights for the engines of a LoRA run that starts from a megatron dist checkpoint.

A LoRA sync sends the engines the adapters alone, so the engines must hold the base weights themselves; a full run
from a dist checkpoint starts them on vLLM's dummy weights and sends them the trainer's, which a LoRA run never does.
When ``model.path`` is a dist checkpoint and ``lora.rank`` > 0, rank 0 converts it once into ``<run_dir>/base_hf``
(``dist_hf.mcore_to_hf``: layer by layer, never the whole model in memory, written to ``base_hf.tmp`` and renamed),
records which checkpoint it came from, and every rank waits for it; the engines start from it, and the run's PEFT
exports name it as their base. A resumed run reuses it; one converted from another ``model.path`` is refused.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from megarl.config.errors import ConfigError
from megarl.config.schema import RunConfig
from megarl.models.hf_config import is_dist_checkpoint, model_files_dir

log = logging.getLogger(__name__)

SOURCE = "megarl_base_source.json"
"""Written into ``base_hf`` last: the dist checkpoint it was converted from (and that it is complete)."""


def lora_base_dir(cfg: RunConfig) -> Path | None:
    """``<run_dir>/base_hf`` for a LoRA run from a dist checkpoint; None otherwise (the engines take ``model.path``'s
    own HF files, or, for a full run from a dist checkpoint, the trainer's weights)."""
    if cfg.lora.rank <= 0 or not is_dist_checkpoint(cfg.model.path):
        return None
    return Path(cfg.train.run_dir) / "base_hf"


def engines_start_empty(cfg: RunConfig) -> bool:
    """Whether the engines start on vLLM's dummy weights and take the trainer's by a first sync: a full run from a
    dist checkpoint (no HF weights to load)."""
    return is_dist_checkpoint(cfg.model.path) and lora_base_dir(cfg) is None


def engine_model_dir(cfg: RunConfig) -> Path:
    """The HF directory the engines start from and a LoRA export names as its base."""
    return lora_base_dir(cfg) or model_files_dir(cfg.model.path)


def ensure_lora_base(cfg: RunConfig, rank: int, poll_s: float = 2.0) -> Path | None:
    """``lora_base_dir(cfg)`` made and checked (rank 0 converts, the others wait for it); None where there is none."""
    out = lora_base_dir(cfg)
    if out is None:
        return None
    source = str(Path(cfg.model.path).resolve())
    if rank == 0:
        if (out / SOURCE).is_file():
            _check_source(out, source)
            log.info(f"lora: the engines' base weights are {out} (converted from {source} earlier)")
        else:
            from megarl.convert.dist_hf import mcore_to_hf  # (megatron: only where a conversion runs)

            if out.exists():  # renamed into place but never marked complete: a conversion cut short
                log.info(f"lora: {out} has no {SOURCE} (a conversion that did not finish): converting again")
                shutil.rmtree(out)

            log.info(f"lora: model.path={source} is a dist checkpoint and a LoRA sync sends the engines the adapters "
                     f"alone: converting its weights to HF at {out} once for them (give the HF checkpoint as "
                     "model.path to skip this)")
            mcore_to_hf(source, out, model_files_dir(source), log=log.info)
            (out / SOURCE).write_text(json.dumps({"model.path": source}) + "\n")
        return out
    waited, said = 0.0, 0.0
    while not (out / SOURCE).is_file():  # (rank 0 converting; if it fails, the launcher ends this rank)
        time.sleep(poll_s)
        waited += poll_s
        if waited - said >= 60:
            said = waited
            log.info(f"lora: waiting for rank 0's conversion into {out} ({waited:.0f} s)")
    _check_source(out, source)
    return out


def _check_source(out: Path, source: str) -> None:
    recorded = json.loads((out / SOURCE).read_text()).get("model.path")
    if recorded != source:
        raise ConfigError(f"{out} holds the HF weights of {recorded}, not of model.path={source}: the run dir "
                          "belongs to another base; remove that directory or use another train.run_dir")
