"""``megarl`` command line: ``train`` (any config), ``demo`` (the tiny CPU default), ``eval`` and ``plan``.

    megarl train --config configs/demo.yaml train.steps=5 optim.lr=3e-5
    megarl train --config configs/demo.yaml --nproc 2 parallel.tp=2
    megarl demo
    megarl eval --config examples/math/config.yaml --checkpoint runs/math   # or model.path=DIR
    megarl plan --model DIR_OR_CONFIG_JSON --nodes 4 --gpus-per-node 8 [--json]   (see megarl/launch/plan.py)

``train`` started by torchrun, ``srun`` (one task per GPU) or ``mpirun`` finds its rank and
rendezvous itself (``megarl/distributed/bootstrap.py``).

The configuration is loaded and validated before any process is launched; a bad
key, type or layout exits with status 2 and a message that names it.

``train`` exits 0 when the run completed or was preempted (checkpoint saved), 1 when a fault stopped it
(e.g. non-finite steps), and 75 (``EXIT_REQUEUE``) when an engine fault stopped it with a checkpoint, or a
checkpoint save failed because a helper process of the writer died (rerun to resume in fresh processes). torchrun exits
1 whatever status its workers had: with ``MEGARL_EXIT_FILE`` set, rank 0 also writes its status there
(``slurm/train.sbatch`` reads it). A call that never returns ends its process with 75 after ``engine.hang_timeout_s``,
that rank writing the file (``megarl/distributed/watchdog.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megarl.config import ConfigError
from megarl.config.errors import PRE_LAUNCH_ERRORS
from megarl.config.validate.limits import check_local_cpus, check_local_engine_memory
from megarl.config.validate.model import model_config
from megarl.config.validate.prelaunch import checked_config
from megarl.distributed.bootstrap import detect, end_distributed, init_distributed
from megarl.launch.plan import main as plan_main
from megarl.logging.console import configure as configure_console

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def _launch_torchrun(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "megarl.cli", args.command, "--worker"]
    if args.config:
        cmd += ["--config", args.config]
    if args.checkpoint:
        cmd += ["--checkpoint", args.checkpoint]
    cmd += args.overrides
    os.execv(sys.executable, cmd)
    return 0  # not reached


def parse(argv: list[str]) -> argparse.Namespace:
    """``train|demo|eval`` arguments (``demo`` without ``--config``: configs/demo.yaml)."""
    parser = argparse.ArgumentParser(prog="megarl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["train", "demo", "eval", "plan"],
                        help="train: run a config; demo: the tiny CPU demo; eval: pass@k of a model or checkpoint; "
                             "plan: layout and memory (plan --help)")
    parser.add_argument("--config", help="YAML config file (demo: configs/demo.yaml by default)")
    parser.add_argument("--nproc", type=int, default=1, help="processes to launch with torchrun (default 1)")
    parser.add_argument("--checkpoint", help="eval: an HF model dir, a dist checkpoint, a run's step dir or a run dir")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="KEY.PATH=VALUE overrides, e.g. optim.lr=3e-5")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after the options
    if args.command == "demo" and not args.config:
        args.config = str(DEMO_CONFIG)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configure_console()
    if argv[:1] == ["plan"]:
        return plan_main(argv[1:])
    if argv[:1] in (["train"], ["demo"], ["eval"]) and any(a in ("-h", "--help") for a in argv[1:]):
        print(_command_help(argv[0]))
        return 0
    args = parse(argv)
    launch = detect()  # torchrun, srun or mpirun started this process (or nobody did)
    notes = not args.worker and launch.rank == 0  # (--worker: spawned by this command, which said them)
    args.worker = args.worker or launch.world_size > 1
    world = launch.world_size if args.worker else args.nproc
    per_node = launch.local_world_size if args.worker else args.nproc
    try:
        if not args.worker and args.nproc < 1:
            raise ConfigError(f"--nproc {args.nproc}: the processes to launch on this machine must be >= 1")
        cfg = checked_config(args.config, args.overrides, world, per_node, args.command, notes,
                             say=_stderr if notes else None)
        check_local_engine_memory(cfg, per_node)  # this machine's memory: here, not in validate (plan sizes others)
        check_local_cpus(cfg, per_node)  # ... and its cores
        if args.command == "eval" and cfg.data.path and not cfg.data.eval_path:
            from megarl.evaluation import NO_EVAL_PATH  # deferred: torch (fast --help and errors)

            raise ConfigError(NO_EVAL_PATH)
        if args.command == "eval" and args.checkpoint:
            from megarl.evaluation import resolve_checkpoint  # deferred: torch (fast --help and errors)

            kind, path = resolve_checkpoint(args.checkpoint)
            if kind == "dist":  # loaded into model.path's model: it must be that model (checkpoint/identity.py)
                from megarl.checkpoint.identity import check_same_model  # deferred: torch (fast --help and errors)

                check_same_model(path, model_config(cfg), f"model.path={cfg.model.path}")
    except PRE_LAUNCH_ERRORS as exc:
        print(f"megarl: config error: {exc}", file=sys.stderr)
        return 2
    if args.nproc > 1 and not args.worker:
        return _launch_torchrun(args)
    if args.worker:
        launch = init_distributed(launch)
        if launch.rank == 0:
            print(f"megarl: {launch.world_size} processes started by {launch.source}, rendezvous "
                  f"{launch.master_addr or os.environ.get('MASTER_ADDR', '')}:"
                  f"{launch.master_port or os.environ.get('MASTER_PORT', '')}", flush=True)

    if args.command == "eval":
        from megarl.evaluation import run_eval  # deferred: torch (fast --help and errors)

        run_eval(cfg, args.checkpoint)
        end_distributed()
        return 0
    from megarl.checkpoint.saver import SaveFailed  # deferred: torch (fast --help and errors)
    from megarl.train import run  # deferred: torch (fast --help and errors)

    try:
        result = run(cfg)
    except SaveFailed as exc:  # transient: the rerun (requeue) resumes from the last complete checkpoint
        print(f"megarl: {exc}", file=sys.stderr, flush=True)
        return _exit_status(requeue=True)
    end_distributed()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"run directory: {Path(result.run_dir).resolve()}")
        if args.command == "demo":
            print(f"demo: pass@1 before={result.pass_at_1_before:.3f} "
                  f"after={result.pass_at_1_after:.3f} steps={result.steps}", flush=True)
    if result.stopped:  # preempted (exit 0: resume with the same command) or stopped by a fault (1, 75)
        print(f"megarl: stopped at step {result.steps}: {result.stopped}", file=sys.stderr, flush=True)
    return _exit_status(result.requeue, result.error)


_COMMANDS = {
    "train": ("run RL post-training with a config (docs/configuration.md lists every key)",
              "megarl train --config configs/demo.yaml --nproc 2 parallel.tp=2 train.steps=5"),
    "demo": ("the tiny CPU demo (configs/demo.yaml unless --config is given)", "megarl demo train.steps=20"),
    "eval": ("pass@k of model.path, or of --checkpoint loaded into model.path's model, on the held-out prompts "
             "(data.eval_path, or the built-in task's); writes eval.output (default: RUN/eval_step_N.json beside a "
             "run's checkpoint, else run_dir/eval.json)",
             "megarl eval --config examples/math/config.yaml --checkpoint runs/math"),
}


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _command_help(command: str) -> str:
    """``megarl train|demo|eval --help``: that command's own usage and options."""
    what, example = _COMMANDS[command]
    p = argparse.ArgumentParser(prog=f"megarl {command}", description=f"{what}.\n\n  e.g. {example}",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="The config is loaded and validated before any process starts; a bad key, "
                                       "type or layout exits 2 naming it.")
    p.add_argument("--config", help="YAML config file" + (" (default configs/demo.yaml)" if command == "demo" else ""))
    p.add_argument("--nproc", type=int, default=1, help="processes to launch with torchrun (default 1)")
    if command == "eval":
        p.add_argument("--checkpoint", help="an HF model dir, a dist checkpoint, a run's step dir or a run dir "
                                            "(a dist checkpoint must hold model.path's architecture)")
    p.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE", help="config overrides, e.g. optim.lr=3e-5")
    return p.format_help()


def _exit_status(requeue: bool = False, error: bool = False) -> int:
    """0, 1 or ``EXIT_REQUEUE`` (see the module docstring); rank 0 writes it to ``$MEGARL_EXIT_FILE`` if set."""
    from megarl.keeper import EXIT_REQUEUE  # deferred: torch (fast --help and errors)

    status = EXIT_REQUEUE if requeue else 1 if error else 0
    path = os.environ.get("MEGARL_EXIT_FILE")
    if path and int(os.environ.get("RANK", "0")) == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path + ".tmp").write_text(f"{status}\n")
        os.replace(path + ".tmp", path)
    return status


if __name__ == "__main__":
    sys.exit(main())
