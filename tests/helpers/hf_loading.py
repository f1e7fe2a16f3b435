"""The trainer's former whole-file load of an HF checkpoint, kept only as the reference that the sharded reader
(``megarl/models/hf_slices.py``) is checked and measured against: every tensor of every safetensors file in memory,
converted to full megatron tensors (``hf_to_megatron``: fresh copies of the fused ones), then one rank's shards cut
(``shard_for_rank``). And the host-memory probe both measure with."""

from __future__ import annotations

import re
from pathlib import Path

import torch


def whole_file_model(model_dir: str | Path, cfg: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at once, as full megatron tensors (a tied output layer: the embedding)."""
    from safetensors.torch import load_file

    from megarl.models.hf_adapter import hf_to_megatron

    hf: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        hf.update(load_file(str(f)))
    full = hf_to_megatron(hf, cfg)
    if cfg.get("tie_word_embeddings"):  # the last stage's output layer is the embedding (one HF tensor)
        full["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    return full


def whole_file_shards(model_dir: str | Path, cfg: dict, coords) -> dict[str, torch.Tensor]:
    """Rank ``coords``'s shards (local-spec names), cut from every tensor of the checkpoint."""
    from megarl.models.hf_config import num_experts
    from megarl.models.sharding import shard_for_rank

    full = whole_file_model(model_dir, cfg)
    return shard_for_rank(full, cfg["num_hidden_layers"], num_experts(cfg), coords)


def whole_file_load(modules: list, model_dir: str | Path, cfg: dict, ps) -> None:
    """What ``load_hf_weights`` did before it read slices (local-spec models): the whole model converted once, each
    chunk's shards cut from it and copied in."""
    from megarl.models.hf_config import num_experts
    from megarl.models.sharding import shard_for_rank

    full = whole_file_model(model_dir, cfg)
    for vp_stage, model in enumerate(modules):
        mine = shard_for_rank(full, cfg["num_hidden_layers"], num_experts(cfg), ps.coords(vp_stage))
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(mine[name].to(p.dtype))


def _status(key: str) -> int:
    return int(re.search(key + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def peak_rss_added(fn) -> int:
    """Bytes of host memory ``fn`` adds at its peak: VmHWM after it (the high-water mark, reset to the current RSS
    by Linux's ``clear_refs`` 5 just before) minus the RSS before it."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before
