"""The whole loop under torchrun: 2 processes, a DP=2 or PP=2 × 2 virtual stages trainer, one vLLM engine
with TP=2 across them."""

import subprocess
import sys

import pytest

from helpers.scripts import ROOT


# The PP case runs PPO with TIS: critic values, reference and proximal logprobs are needed on every stage.
# Slow since the preset fix made it really train PPO with a critic (~160 s; it ran GRPO before); dp2 is the
# fast representative of a two-process run.
@pytest.mark.parametrize("layout", [pytest.param([], id="dp2"),
                                    pytest.param(["parallel.pp=2", "parallel.vpp=2", "optim.micro_batch_size=16",
                                                  "algo.preset=ppo", "algo.tis=token"], id="pp2_vpp2_ppo",
                                                 marks=pytest.mark.slow)])
def test_train_with_two_processes(tmp_path, layout):
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/demo.yaml", "--nproc", "2",
           "engine.tensor_parallel_size=2", "warmup.steps=3", "train.steps=2", "train.time_limit_s=0",
           f"train.run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}", "data.eval_size=8",
           "rollout.prompts_per_step=8", "engine.slots=64", *layout]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]  # nor at exit: the engines' and the groups' ends agree
    out = proc.stdout
    assert "step 2/2 |" in out and "eval after RL: pass@1" in out
    assert "warmup 3/3 | nll " in out and "nll nan" not in out  # rank 0 reports the last stage's loss
    assert out.count("step 1/2 |") == 1  # one console line per step (rank 0 only)
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "run" / "hf" / "step_2" / "model.safetensors").is_file()  # the end-of-run HF export
