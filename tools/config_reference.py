#!/usr/bin/env python
"""The key reference of docs/configuration.md, generated from megarl/config/schema.py (megarl/config/reference.py).

    python tools/config_reference.py           # print the generated part
    python tools/config_reference.py --write   # rewrite it in docs/configuration.md
    python tools/config_reference.py --check   # exit 1 if docs/configuration.md is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megarl.config.reference import PAGE, generated_part, render, updated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help="rewrite the page's generated part in place")
    what.add_argument("--check", action="store_true", help="exit 1 if the page's generated part is stale")
    parser.add_argument("--page", type=Path, default=PAGE, help=f"the page (default: {PAGE.name} in docs/)")
    args = parser.parse_args(argv)
    if not (args.write or args.check):
        print(render())
        return 0
    page = args.page.read_text()
    if args.check:
        if generated_part(page) != render():
            print(f"{args.page} is stale: run python tools/config_reference.py --write", file=sys.stderr)
            return 1
        return 0
    args.page.write_text(updated(page))
    return 0


if __name__ == "__main__":
    sys.exit(main())
