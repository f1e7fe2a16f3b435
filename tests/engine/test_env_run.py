"""Multi-turn RL end to end: ``megarl train`` of a tiny model (warmed up to end its turns with EOS) whose samples
each talk to an environment from ``tests/helpers/envs.py`` for two turns, some of whose episodes raise, return a
wrong type or hang: the run trains, the environment's tokens are a share of each trajectory that no loss counts,
and every failure is contained, ended and counted in ``env/*``."""

import sys

import pytest

from helpers.runs import train
from helpers.scripts import ROOT


def scalars(run_dir) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow  # (a real run: about two minutes; the controller's episodes are tests/unit/test_env_episodes.py's)
@pytest.mark.parametrize("mode,overlap", [("sync", "none"), ("partial", "one_step"), ("partial", "async")])
def test_a_multi_turn_run_trains_masks_environment_tokens_and_counts_environment_failures(tmp_path, mode, overlap):
    run = tmp_path / "run"
    out = train([sys.executable, "-m", "megarl.cli", "train", "--config", "configs/demo.yaml",
                 "model.make_tiny=qwen2", f"model.path={tmp_path}/model", f"train.run_dir={run}",
                 "warmup.steps=20", "warmup.batch_size=16", "train.steps=3", "train.time_limit_s=0",
                 "data.eval_size=0", "data.max_digits=2", f"rollout.mode={mode}", f"rollout.overlap={overlap}",
                 *(["engine.placement=disaggregated"] if overlap != "none" else []),
                 "rollout.prompts_per_step=3",
                 "rollout.samples_per_prompt=4", "rollout.max_new_tokens=96", "engine.max_model_len=160",
                 "engine.slots=16", "engine.kv_cache_gib=0.25", "optim.micro_batch_size=12",
                 "env.fn=helpers.envs:Rotating", "env.timeout_s=2", "env.workers=2", "env.max_turns=3"],
                run, env={"PYTHONPATH": str(ROOT / "tests")}, timeout=600)
    s = scalars(run)
    assert len(s["loss/policy"]) == 3, out[-3000:]
    assert max(s["rollout/turns_max"]) == 2 and max(s["rollout/turns_mean"]) > 1.0  # second turns were taken
    assert 0.0 < max(s["rollout/env_token_fraction"]) < 1.0
    # the loss counted the model's tokens of the 12 samples a step trains, never the environment's
    for tokens, mean in zip(s["loss/tokens"], s["response/len_mean"]):
        assert tokens == pytest.approx(12 * mean)
    # failures, contained: the run went on; each counted where it happened (cumulative counts)
    assert s["env/calls"][-1] > 0 and s["env/errors"][-1] >= 1 and s["env/timeouts"][-1] >= 1
    assert sum(s["rollout/env_errors"]) >= 2
    assert "timing/env_s" in s and "environment: sample" in out
