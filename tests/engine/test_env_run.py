"""Multi-turn RL end to end: ``megarl train`` of a tiny model (warmed up to end its turns with EOS) whose samples
each talk to an environment from ``tests/helpers/envs.py`` for two turns, some of whose episodes raise, return a
wrong type or hang: the run trains, the environment's tokens are a share of each trajectory that no loss counts,
and every failure is contained, ended and counted in ``env/*``."""

import signal
import sys

import pytest

from helpers.runs import final_state, no_prompt_lost_or_twice, scalars, train
from helpers.scripts import ROOT
from megarl.logging.metrics import read_metrics

pytestmark = pytest.mark.alone  # env steps under a 2 s timeout: never beside another test (make test)


def env_run(tmp_path, run, mode="sync", overlap="none", steps=3, *extra) -> list[str]:
    return [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/demo.yaml",
            "model.make_tiny=qwen2", f"model.path={tmp_path}/model", f"train.run_dir={run}",
            "warmup.steps=20", "warmup.batch_size=16", f"train.steps={steps}", "train.time_limit_s=0",
            "data.eval_size=0", "data.max_digits=2", f"rollout.mode={mode}", f"rollout.overlap={overlap}",
            *(["engine.placement=disaggregated"] if overlap != "none" else []),
            "rollout.prompts_per_step=3", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=96",
            "engine.max_model_len=160", "engine.slots=16", "engine.kv_cache_gib=0.25", "optim.micro_batch_size=12",
            "env.fn=helpers.envs:Rotating", "env.timeout_s=2", "env.workers=2", "env.max_turns=3", *extra]


@pytest.mark.slow  # (a real run: about two minutes; the controller's episodes are tests/unit/test_env_episodes.py's)
@pytest.mark.parametrize("mode,overlap", [("sync", "none"), ("partial", "one_step"), ("partial", "async")])
def test_a_multi_turn_run_trains_masks_environment_tokens_and_counts_environment_failures(tmp_path, mode, overlap):
    run = tmp_path / "run"
    out = train(env_run(tmp_path, run, mode, overlap), run, env={"PYTHONPATH": str(ROOT / "tests")}, timeout=600)
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
    assert "timing/env_s" in s and "environment: sample" in out and sum(s["rollout/tool_calls"]) > 0


@pytest.mark.slow
def test_a_kill_9_mid_run_resumes_with_its_environment_counts_and_no_prompt_lost(tmp_path):
    """Partial mode (episodes outlive a phase) with a slow tool, killed in step 3's optimizer step and resumed from
    step 2's checkpoint: the run ends, the env/* counts go on from the checkpoint's, no prompt is lost or held twice,
    and the episodes the checkpoint caught mid-way go on from their instances as it kept them (none restarted or
    lost)."""
    run, env = tmp_path / "run", {"PYTHONPATH": str(ROOT / "tests"), "SLOW_ENV_S": "0.3"}  # (a slow tool: the
    args = env_run(tmp_path, run, "partial", "none", 4, "train.save_every=2",  # checkpoint catches episodes mid-way)
                   "env.fn=helpers.envs:Slow")
    train(args, run, env={**env, "MEGARL_TEST_KILL": "optimizer_step@3"}, rc=-signal.SIGKILL, timeout=600)
    out = train(args, run, env=env, timeout=600)
    assert "resumed from" in out and "step_000002" in out
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "loss/policy" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    calls = [r["env/calls"] for r in steps]
    assert calls == sorted(calls) and calls[2] > calls[1] > 0  # (restored, not restarted from 0)
    assert steps[2]["env/resumed"] > 0 and steps[-1]["env/restarted"] == 0  # (continued from their instances)
    assert "starts again from its prompt" not in out and "lost: " not in out  # (Slow never fails: none lost)
    no_prompt_lost_or_twice(final_state(run))
