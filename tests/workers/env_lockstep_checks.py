"""Multi-turn episodes with two trainer processes in lockstep (colocated): each rank runs the same controller over
its own scripted engine (rank 1's steps slower in wall time), rank 0's pool alone runs the environments, and every
rank takes rank 0's answers at the same point of the phase. Prints one JSON line per rank 0: both ranks' engine
submissions, released groups and trajectories.

Usage: python -m torch.distributed.run --standalone --nproc-per-node=2 tests/workers/env_lockstep_checks.py
"""

from __future__ import annotations

import json

import torch.distributed as dist

from helpers.processes import end_process_group
from helpers.scripted import ScriptedEngine
from megarl.data.chat import TurnRenderer
from megarl.envs.pool import EnvPool
from megarl.models.tiny import CHATML_TEMPLATE, build_tokenizer
from megarl.rollout.controller import ControllerConfig, PromptItem, RolloutController
from megarl.rollout.turns import Episodes

ROWS = [{"turns": t, "delay": d} for t, d in ((3, 0.06), (2, 0.0), (4, 0.03), (2, 0.08), (3, 0.01), (4, 0.05))]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tok = build_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "go"}], chat_template=CHATML_TEMPLATE,
                                     add_generation_prompt=True, tokenize=True)["input_ids"]
    items = iter(PromptItem(i, list(prompt), "go", "", key=i, extras=row) for i, row in enumerate(ROWS))
    engine = ScriptedEngine(tok, slots=3, step_s=0.02 * rank)  # (rank 1 sees answers arrive at other steps)
    pool = EnvPool("helpers.envs:Sleepy", workers=2, timeout_s=5.0, runs=rank == 0)
    episodes = Episodes(pool, TurnRenderer(tok, CHATML_TEMPLATE), tok, 4, 200, shared=True)
    cfg = ControllerConfig(mode="partial", group_size=2, update_groups=1, rollout_groups=3, max_tokens=200,
                           staleness_limit=8)
    c = RolloutController(cfg, [engine], lambda: next(items, None), episodes=episodes)
    released = []
    try:
        for version in range(30):
            groups, _ = c.run_phase(version)
            released += groups
            if len(released) >= len(ROWS):
                break
    finally:
        pool.close()
    mine = {"rank": rank, "workers": len(pool._workers) if version == 0 else None, "runs": pool.runs,
            "submitted": [[list(key), generated] for key, generated in engine.log],
            "released": [g.prompt_index for g in released],
            "trajectories": [[s.response_ids for s in g.samples] for g in released],
            "turns": [[s.turns for s in g.samples] for g in released],
            "errors": [s.env_error for g in released for s in g.samples], "calls": pool.calls}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:
        print(json.dumps({"ranks": every, "rows": ROWS}))
    end_process_group()


if __name__ == "__main__":
    main()
