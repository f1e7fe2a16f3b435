"""A disaggregated replica SIGKILLed during the held-out evaluation: the keeper restarts the replicas, gives them
the trainer's weights and evaluates again; with no restarts left the evaluation is skipped (NaN, counted) and
the next phase's engine error stops the run (``StopRun``: checkpoint, exit status 75), never a crash.

    python tests/workers/eval_fault_checks.py RUN_DIR [key=value ...]

Prints one JSON line. Every replica process is ended on exit.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import sys
import time


class KillOnGenerate:
    """A replica's pipe that SIGKILLs the replica right after handing it a ``generate`` command."""

    def __init__(self, client) -> None:
        self.conn, self.proc = client.conn, client.proc

    def send(self, message) -> None:
        self.conn.send(message)
        if type(message).__name__ == "Generate":
            os.kill(self.proc.pid, signal.SIGKILL)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def main(run_dir: str, *overrides: str) -> None:
    from megarl.config import load_config
    from megarl.keeper import RunKeeper, StopRun
    from megarl.session import build_session
    from megarl.train import pass_at_1
    from megarl.types import GenerationRequest

    cfg = load_config("configs/demo.yaml", [
        f"train.run_dir={run_dir}", f"model.path={run_dir}/model", "engine.placement=disaggregated",
        "engine.replicas=2", "engine.kv_cache_gib=0.0625", "engine.slots=4", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8", "data.eval_size=4", "warmup.steps=0",
        "engine.max_restarts=1", *overrides])
    s = build_session(cfg)
    try:
        keeper = RunKeeper(s)
        probe = [GenerationRequest(p.ids, n=1, max_tokens=8, greedy=True) for p in s.eval_prompts]

        def greedy():  # what the evaluation scores: the greedy responses to the held-out prompts
            return [c[0].token_ids for c in s.engines.generate(probe, seed=0)]

        clean = keeper.evaluate(lambda: pass_at_1(s), 0)
        tokens_before = greedy()
        pids = [c.proc.pid for c in s.engines.clients]
        victim = s.engines.clients[0]  # the replica evaluation runs on
        victim.conn = KillOnGenerate(victim)
        log = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):  # (faults are warnings: stderr)
            recovered = keeper.evaluate(lambda: pass_at_1(s), 0)
        recovered_s = time.perf_counter() - start
        tokens_after = greedy()
        restarted = {"pids": [c.proc.pid for c in s.engines.clients], "alive": [c.proc.is_alive() for c in
                     s.engines.clients], "versions": list(s.engines.versions), "faults": keeper.fault_metrics(1)}
        # no restarts left: killed again, the evaluation is skipped; the next phase meets the dead replica
        keeper.faults.max_restarts = 0
        victim.conn = KillOnGenerate(victim)
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            skipped = keeper.evaluate(lambda: pass_at_1(s), 0)
            try:
                keeper.next_rollout(0, 0)
                stop = ""
            except StopRun as exc:
                stop = str(exc)
        print(json.dumps({
            "clean": clean, "recovered": recovered, "same_tokens": tokens_before == tokens_after,
            "recovered_s": recovered_s, "pids_before": pids, **restarted,
            "skipped_is_nan": math.isnan(skipped), "evals_skipped": keeper.faults.evals_skipped, "stop": stop,
            "restarts": keeper.faults.restarts, "log": log.getvalue().splitlines(),
        }), flush=True)
    finally:
        s.engines.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
