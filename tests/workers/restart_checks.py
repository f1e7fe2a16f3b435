"""An engine fault mid-phase under torchrun: the keeper recovers the colocated engine and the run goes on.

    MEGARL_TEST_FAULT=engine_error@1 torchrun --nproc-per-node 2 tests/workers/restart_checks.py RUN_DIR [key=value ...]

Builds the run's session (trainer TP 2; ``engine.tensor_parallel_size=1``: two replicas, or ``=2``: one
engine over both ranks), runs two RL steps through the keeper (the injected engine error fires in step 1,
on every rank's engine), saves a run checkpoint, and checks the engine still generates and matches the
trainer (``helpers.trainers.rank_gaps``). With ``engine_unrecoverable@1`` too, the recovery is refused: the keeper's
``StopRun`` saves a checkpoint of the steps done, as ``megarl train`` does. Rank 0 prints one JSON line with every
rank's record.
"""

from __future__ import annotations

import json
import sys


def main(run_dir: str, *overrides: str) -> None:
    import torch.distributed as dist

    from helpers.trainers import rank_gaps
    from megarl.config import load_config
    from megarl.keeper import RunKeeper, StopRun
    from megarl.session import build_session
    from megarl.train import rl_step

    cfg = load_config("configs/demo.yaml", [
        f"train.run_dir={run_dir}", f"model.path={run_dir}/model", "model.make_tiny=qwen2",
        "parallel.tp=2", "engine.kv_cache_gib=0.25", "engine.slots=8", "engine.max_model_len=64",
        "rollout.mode=partial", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=8", "data.max_digits=2", "data.eval_size=2", "optim.micro_batch_size=4",
        "warmup.steps=0", "train.steps=2", "train.time_limit_s=0", *overrides])
    s = build_session(cfg)
    rank = dist.get_rank()
    keeper = RunKeeper(s)
    steps, error, stopped = 0, "", ""
    try:
        for step in range(2):
            rl_step(s, step, keeper)
            steps += 1
        keeper.save(steps)
    except StopRun as stop:  # what megarl train does: save and stop (exit status 1)
        stopped = str(stop)
        keeper.stop(steps, stop)
    except Exception as exc:  # noqa: BLE001  (reported, the test fails on it)
        error = f"{type(exc).__name__}: {exc}"
    gaps = rank_gaps(s.engines.engine, s.trainer) if not (error or stopped) else None
    record = {"rank": rank, "steps": steps, "restarts": keeper.faults.restarts, "error": error, "stopped": stopped,
              "saved_at": s.saver.saved_at, "gaps": gaps}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, record)
    if rank == 0:
        print(json.dumps({"engine_tp": cfg.engine.tensor_parallel_size, "ranks": every}), flush=True)
    dist.barrier()
    s.rewards.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
