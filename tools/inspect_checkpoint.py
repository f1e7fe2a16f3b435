#!/usr/bin/env python
"""List a checkpoint's tensors (HF safetensors directory or megatron dist checkpoint) and sum it up.

    python tools/inspect_checkpoint.py /models/Qwen3-30B-A3B
    python tools/inspect_checkpoint.py runs/x/checkpoints/step_000100 --hf-config /models/Qwen3-30B-A3B --summary

Prints name, shape and dtype of each tensor (reading headers and metadata only, no weights),
then the total size, the parameter count (total, and active per token for MoE: the routed
experts count ``num_experts_per_tok / num_experts``), and for a dist checkpoint the layout it
was saved at as far as its chunks tell (tensor parallel from the split of ``linear_qkv``; a
converted checkpoint records the layout it was checked for) and whether it holds optimizer state.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_EXPERT = re.compile(r"\.experts\.(\d+\.)?|\.experts\.experts\.")


def tensors_of(path: Path) -> tuple[str, dict]:
    """('hf' | 'mcore', name → (shape, dtype name))."""
    if (path / "metadata.json").is_file():
        from megarl.checkpoint.identity import saved_tensors

        return "mcore", {k: (tuple(v.size), str(v.properties.dtype).removeprefix("torch."))
                         for k, v in saved_tensors(path).items()}
    from megarl.models.hf_reader import HFCheckpoint

    ckpt = HFCheckpoint(path)
    return "hf", {k: (shape, str(dtype).removeprefix("torch.")) for k, (_, dtype, shape, _, _) in ckpt.entries.items()}


def count(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="HF directory, megatron dist checkpoint directory, "
                        "a run's checkpoint step dir or a run dir (their policy)")
    parser.add_argument("--hf-config", default=None, help="config.json directory (for active parameters of MoE)")
    parser.add_argument("--summary", action="store_true", help="only the summary, not every tensor")
    args = parser.parse_args(argv)
    path = Path(args.path)
    try:
        # a run dir has a config.json too (megarl's run config): its checkpoints/ tell it from an HF dir
        run = (path / "checkpoints" / "latest").is_file() or (path / "checkpoints").is_dir()
        if not (path / "metadata.json").is_file() and (run or not (path / "config.json").is_file()):
            from megarl.convert.dist_hf import dist_checkpoint_dir

            path = dist_checkpoint_dir(path, lambda m: print(m.replace("--ckpt: ", "", 1)))  # its policy
        kind, tensors = tensors_of(path)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        print(f"inspect_checkpoint: error: {exc}", file=sys.stderr)
        return 2
    import torch

    model = {k: v for k, v in tensors.items() if not k.startswith(("optimizer.", "chained_"))}
    if not args.summary:
        for name, (shape, dtype) in sorted(model.items()):
            print(f"{name}  {list(shape)}  {dtype}")
    size = sum(count(s) * getattr(torch, d).itemsize for s, d in model.values())
    total = sum(count(s) for s, _ in model.values())
    expert = sum(count(s) for k, (s, _) in model.items() if _EXPERT.search(k) and "shared_expert" not in k)
    cfg_dir = Path(args.hf_config) if args.hf_config else (path / "hf" if kind == "mcore" else path)
    if kind == "mcore" and not (cfg_dir / "config.json").is_file():  # a run's: the model.path it records
        from megarl.checkpoint.identity import recorded_source

        cfg_dir = recorded_source(path)[1] or cfg_dir
    cfg = json.loads((cfg_dir / "config.json").read_text()) if (cfg_dir / "config.json").is_file() else {}
    from megarl.models.hf_config import num_experts

    experts = num_experts(cfg)
    active = total - expert + (expert * cfg["num_experts_per_tok"] // experts if experts else 0)
    counted = "megatron tensors (layers stacked)" if kind == "mcore" else "HF tensors"
    if experts:
        active_words = f", {active:,} active per token ({cfg['num_experts_per_tok']} of {experts} experts)"
    elif expert:  # expert tensors, but no config (or another model's) to say how many experts a token uses
        said = f"{cfg_dir / 'config.json'} is not an MoE model's" if cfg else f"no config.json in {cfg_dir}"
        active_words = f"; active per token unknown: the checkpoint has expert tensors and {said} (--hf-config DIR)"
    else:
        active_words = ""
    print(f"{kind} checkpoint {path}: {len(model)} {counted}, {size / 2**30:.3f} GiB, {total:,} parameters"
          + active_words)
    if kind == "mcore":
        qkv = [k for k in tensors if k.endswith("linear_qkv.weight")]
        if qkv:
            from megarl.checkpoint.identity import saved_tensors

            chunks = saved_tensors(path)[qkv[0]].chunks
            tp = len({c.offsets[1] for c in chunks})
            print(f"saved at tensor parallel {tp} (linear_qkv in {tp} row block(s) per layer)")
        from megarl.checkpoint.dist import LAYOUT_FILE

        if (path / LAYOUT_FILE).is_file():
            print(f"saved at layout {json.loads((path / LAYOUT_FILE).read_text())}")
        conv = path / "megarl_conversion.json"
        if conv.is_file():
            info = json.loads(conv.read_text())
            print(f"converted from {info['from_hf']}; checked for layout {info['layout']} (stored unsharded)")
        optimizer = len(tensors) - len(model)
        print(f"optimizer state: {optimizer} tensors" if optimizer else "optimizer state: none (model only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
