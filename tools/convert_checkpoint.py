#!/usr/bin/env python
"""Convert between HF safetensors and megatron dist checkpoints, streaming layer by layer.

    # HF → megatron (checked for the layout you will train at; loads at any layout)
    python tools/convert_checkpoint.py hf-to-mcore --hf /models/Qwen2.5-32B --out ckpt/q32b --tp 8 --pp 2
    # a run's checkpoint (any layout it was saved at; its step dir, or the run dir for the latest) → HF
    python tools/convert_checkpoint.py mcore-to-hf --ckpt runs/x/checkpoints/step_000100 --out hf/x --dtype bf16
    # (--hf-config DIR: the model's config and tokenizer; default: a converted checkpoint's hf/, or the
    #  model.path a run's config.json records; a checkpoint of another model is refused, naming both)
    # print the plan (tensors, shapes, dtypes, target files, bytes), write nothing
    python tools/convert_checkpoint.py hf-to-mcore --hf /models/Qwen3-30B-A3B --out ckpt/a3b --ep 8 --dry-run
    # a GGUF file (llama.cpp's format; dequantized) → an HF directory in bf16 (default) or fp32
    python tools/convert_checkpoint.py gguf-to-hf --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out models/smollm2

Peak memory is about one layer (hf-to-mcore) or one layer plus one output shard (mcore-to-hf),
not the model. Output goes to OUT.tmp and is renamed to OUT when complete.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors directory → megatron dist checkpoint")
    a.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
    for flag in ("tp", "pp", "ep", "vpp"):
        a.add_argument(f"--{flag}", type=int, default=1, help=f"training layout to check ({flag.upper()})")
    a.add_argument("--etp", type=int, default=0, help="expert tensor parallel (0: = tp)")
    b = sub.add_parser("mcore-to-hf", help="megatron dist checkpoint → HF safetensors directory")
    b.add_argument("--ckpt", required=True, help="dist checkpoint directory (has metadata.json), a run's "
                   "checkpoint step dir (run_dir/checkpoints/step_N: its policy/) or a run dir (its latest)")
    b.add_argument("--hf-config", default=None, help="HF directory with config.json and tokenizer "
                   "(default: CKPT/hf, written by hf-to-mcore, or the model.path of the run's config.json)")
    b.add_argument("--max-shard-gb", type=float, default=5.0, help="largest output safetensors file")
    g = sub.add_parser("gguf-to-hf", help="GGUF file (llama.cpp's format) → HF safetensors directory")
    g.add_argument("--gguf", required=True, help="the .gguf file (dequantized by transformers: needs gguf, accelerate)")
    for p in (a, b, g):
        p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
        p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16" if p is g else None,
                       help="store tensors in this dtype (default: as the source; gguf-to-hf: bf16)")
        p.add_argument("--dry-run", action="store_true", help="print the plan and write nothing")
    return parser.parse_args(argv)


def check_layout_args(args) -> None:
    """ValueError naming the flag for a layout value no run can have (before any division by it):
    --tp/--pp/--ep/--vpp >= 1, --etp >= 0 (0: = tp) and only on an MoE model (it splits experts)."""
    for flag in ("tp", "pp", "ep", "vpp"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} {getattr(args, flag)}: must be >= 1 (1: not split)")
    if args.etp < 0:
        raise ValueError(f"--etp {args.etp}: must be >= 0 (0: the same as --tp)")
    from megarl.models.hf_config import missing_safetensors, num_experts

    config = Path(args.hf) / "config.json"
    if args.etp and config.is_file() and not num_experts(json.loads(config.read_text())):
        raise ValueError(f"--etp {args.etp} needs an MoE model (expert tensor parallel splits the experts); "
                         f"{config} has no experts: leave --etp at 0")
    if config.is_file() and (problem := missing_safetensors(args.hf)):
        raise FileNotFoundError(problem)


def main(argv=None) -> int:
    args = parse(argv)
    warnings.filterwarnings("ignore")
    from megarl.convert.dist_hf import DTYPE_NAMES, hf_to_mcore, mcore_to_hf

    dtype = DTYPE_NAMES[args.dtype] if args.dtype else None
    try:
        if args.direction == "gguf-to-hf":
            from megarl.convert.gguf import gguf_to_hf

            gguf_to_hf(args.gguf, args.out, dtype, args.dry_run)
        elif args.direction == "hf-to-mcore":
            check_layout_args(args)
            layout = {k: getattr(args, k) for k in ("tp", "pp", "ep", "etp", "vpp")}
            hf_to_mcore(args.hf, args.out, layout, dtype, args.dry_run)
        else:
            mcore_to_hf(args.ckpt, args.out, args.hf_config, dtype, int(args.max_shard_gb * 2**30), args.dry_run)
    except ModuleNotFoundError as exc:  # gguf-to-hf's own packages
        print(f"convert_checkpoint: error: {exc}: pip install gguf accelerate", file=sys.stderr)
        return 2
    except (ValueError, KeyError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError) as exc:
        print(f"convert_checkpoint: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # the dist-checkpoint reader/writer needs the guard
    sys.exit(main())
