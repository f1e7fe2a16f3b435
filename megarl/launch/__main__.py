"""``python -m megarl.launch run-dir [--config FILE] [key=value ...]``: print the run directory.

The job scripts in ``slurm/`` use it to put their logs beside the run's checkpoints and metrics.
"""

from __future__ import annotations

import argparse
import sys

from megarl.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megarl.launch")
    ap.add_argument("what", choices=["run-dir"])
    ap.add_argument("--config")
    ap.add_argument("overrides", nargs="*")
    args, _ = ap.parse_known_intermixed_args(argv)  # other `megarl train` options (--nproc) are not ours
    try:
        print(load_config(args.config, args.overrides).train.run_dir)
    except ConfigError as exc:
        print(f"megarl: config error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
