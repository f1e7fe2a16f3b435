"""The base model's HF weights for the engines of a LoRA run that starts from a megatron dist checkpoint.

A LoRA sync sends the engines the adapters alone, so the engines must hold the base weights themselves; a full run
from a dist checkpoint starts them on vLLM's dummy weights and sends them the trainer's, which a LoRA run never does.
When ``model.path`` is a dist checkpoint and ``lora.rank`` > 0, rank 0 converts it once into ``<run_dir>/base_hf``
(``dist_hf.mcore_to_hf``: layer by layer, never the whole model in memory, written to ``base_hf.tmp`` and renamed),
records which checkpoint it came from (its path and metadata files' sizes and times), and every rank waits for that
record; the engines start from it, and the run's PEFT exports name it as their base. A resumed run reuses it, a
checkpoint rewritten in place since is converted again, and one converted from another ``model.path`` is refused.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from megarl.config.errors import ConfigError
from megarl.config.schema import RunConfig
from megarl.models.hf_config import is_dist_checkpoint, model_files_dir

log = logging.getLogger(__name__)

SOURCE = "megarl_base_source.json"
"""Written into ``base_hf`` last (atomically): the dist checkpoint it was converted from, and that it is complete."""


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
    stamp = _stamp(Path(cfg.model.path).resolve())
    if rank != 0:
        waited, said = 0.0, 0.0
        while _recorded(out) != stamp:  # (rank 0 converting; if it fails, the launcher ends this rank)
            time.sleep(poll_s)
            waited += poll_s
            if waited - said >= 60:
                said = waited
                log.info(f"lora: waiting for rank 0's conversion into {out} ({waited:.0f} s)")
        return out
    recorded = _recorded(out)
    if recorded == stamp:
        log.info(f"lora: the engines' base weights are {out} (converted from {stamp['model.path']} earlier)")
        return out
    if recorded and recorded.get("model.path") != stamp["model.path"]:
        raise ConfigError(f"{out} holds the HF weights of {recorded.get('model.path')}, not of model.path="
                          f"{stamp['model.path']}: the run dir belongs to another base; remove that directory or use "
                          "another train.run_dir")
    from megarl.convert.dist_hf import mcore_to_hf  # (megatron: only where a conversion runs)

    if out.exists():  # the checkpoint rewritten since, or a conversion cut short before its mark
        log.info(f"lora: {out} is {'of the checkpoint as it was before' if recorded else 'unfinished'}: "
                 "converting again")
        shutil.rmtree(out)
    log.info(f"lora: model.path={stamp['model.path']} is a dist checkpoint and a LoRA sync sends the engines the "
             f"adapters alone: converting its weights to HF at {out} once for them (give the HF checkpoint as "
             "model.path to skip this)")
    mcore_to_hf(stamp["model.path"], out, model_files_dir(stamp["model.path"]), log=log.info)
    mark = out / f"{SOURCE}.tmp"
    mark.write_text(json.dumps(stamp) + "\n")
    os.replace(mark, out / SOURCE)  # (whole or absent for the ranks that read it)
    return out


def _stamp(ckpt: Path) -> dict:
    """The checkpoint as written: its path and its metadata files' sizes and modification times."""
    stats = {name: (ckpt / name).stat() for name in ("metadata.json", ".metadata") if (ckpt / name).is_file()}
    return {"model.path": str(ckpt), "files": {n: [st.st_size, st.st_mtime_ns] for n, st in stats.items()}}


def _recorded(out: Path) -> dict | None:
    """The stamp a finished conversion into ``out`` recorded, or None."""
    try:
        return json.loads((out / SOURCE).read_text())
    except (OSError, ValueError):
        return None
