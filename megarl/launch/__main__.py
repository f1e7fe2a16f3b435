"""``python -m megarl.launch run-dir|engine-nodes|check [--nodes N] [--config FILE] [key=value ...]``: what a job
script asks the config.

``run-dir``: the run directory (the scripts in ``slurm/`` put their logs beside the run's checkpoints and
metrics). ``engine-nodes``: how many of the allocation's last nodes run only engine replicas
(``engine.replica_nodes`` with ``engine.replica_nodes_dedicated``, else 0): ``slurm/train.sbatch`` starts
torchrun on the others and ``python -m megarl.engines.remote.host`` on those. With ``--nodes N`` (the job's node count)
it also refuses ``engine.replica_nodes`` that the job's nodes cannot hold (a one-line config error, exit 2), before
srun. ``check --nodes N --gpus-per-node G [--node-gpus M]``: every check ``megarl train`` makes before it starts (the
model path and its weights, the layout at N trainer nodes × G processes, ``engine.replica_devices`` among a node's M
GPUs apart from the trainer's, the data and reward, the checkpoint a resume continues
from), run by the batch script before srun: a bad ``model.path`` is one config error in the batch log (exit 2),
not every node failing after the allocation started.
"""

from __future__ import annotations

import argparse
import sys

from megarl.config import load_config
from megarl.config.errors import PRE_LAUNCH_ERRORS
from megarl.config.validate.layout import check_replica_nodes_fit, validate_replica_nodes
from megarl.config.validate.prelaunch import checked_config
from megarl.launch.plan import engine_only_nodes, trainer_nodes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megarl.launch")
    ap.add_argument("what", choices=["run-dir", "engine-nodes", "check"])
    ap.add_argument("--config")
    ap.add_argument("--nodes", type=int, default=0,
                    help="engine-nodes: the job's node count (checked against it); check: the trainer nodes")
    ap.add_argument("--gpus-per-node", type=int, default=1, help="check: the trainer's processes per node")
    ap.add_argument("--node-gpus", type=int, default=0, help="check: each node's GPUs (Slurm's SLURM_GPUS_ON_NODE; "
                    "engine.replica_devices must be among them, apart from the trainer's; 0: not checked)")
    ap.add_argument("overrides", nargs="*")
    args, _ = ap.parse_known_intermixed_args(argv)  # other `megarl train` options (--nproc) are not ours
    try:
        cfg = load_config(args.config, args.overrides)
        if args.what == "engine-nodes":
            validate_replica_nodes(cfg.engine)
            if args.nodes:
                trainer_nodes(cfg, args.nodes)  # engine-only nodes leave at least one trainer node
                if not cfg.engine.replica_nodes_dedicated:
                    check_replica_nodes_fit(cfg.engine.replicas, cfg.engine.replica_nodes, args.nodes)
            print(engine_only_nodes(cfg))
        elif args.what == "check":
            nodes, per_node = max(args.nodes, 1), max(args.gpus_per_node, 1)
            checked_config(args.config, args.overrides, nodes * per_node, per_node, "train", node_gpus=args.node_gpus)
        else:
            print(cfg.train.run_dir)
    except PRE_LAUNCH_ERRORS as exc:
        print(f"megarl: config error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
