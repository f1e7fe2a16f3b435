#!/usr/bin/env python
"""Create a tiny HF checkpoint (config, safetensors, tokenizer) for tests and demos; nothing is downloaded.

    python tools/make_tiny_model.py runs/tiny_moe --family qwen3_moe --seed 0
    python tools/make_tiny_model.py runs/tiny_dense --family qwen2 --hidden-size 64 --layers 2
"""

from __future__ import annotations

import argparse
import dataclasses

from megarl.models.tiny import TinyShape, make_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="output directory")
    parser.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "qwen2"])
    parser.add_argument("--seed", type=int, default=0)
    defaults = TinyShape()
    for field in dataclasses.fields(TinyShape):
        if field.name != "family":
            flag = "--" + field.name.replace("_", "-").replace("num-", "")
            parser.add_argument(flag, dest=field.name, type=type(getattr(defaults, field.name)),
                                default=getattr(defaults, field.name))
    args = parser.parse_args()
    shape = TinyShape(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TinyShape)})
    path = make_tiny_model(args.path, shape, seed=args.seed)
    print(f"wrote {shape.family} checkpoint to {path}")


if __name__ == "__main__":
    main()
