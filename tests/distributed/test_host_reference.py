"""``trainer.reference_on_host``: the KL reference's weights kept on the host and copied into the policy's model for
its forward (``rl_update.HostReference``) score a batch exactly as a reference model of its own does, and leave the
policy's weights and logprobs bit for bit as they were: a dense model in one process, a tiny MoE's experts at EP 2,
a dense model at PP 2 (each rank swaps its own stage's shards). Real megatron-core on gloo."""

import pytest

from helpers.scripts import run_script
from megarl.models.tiny import TinyShape, make_tiny_model


@pytest.mark.parametrize("family, layout", [("qwen2", "single"),
                                            pytest.param("qwen3_moe", "ep2_alltoall", marks=pytest.mark.slow),
                                            pytest.param("qwen2", "pp2", marks=pytest.mark.slow)])
def test_a_host_reference_scores_as_its_own_model_and_gives_the_policy_back(tmp_path, family, layout):
    model = make_tiny_model(tmp_path / family, TinyShape(family=family), seed=3)
    launcher = [] if layout == "single" else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    r = run_script([*launcher, "tests/workers/host_reference_checks.py", layout, str(model)],
                   env={"OMP_NUM_THREADS": "1"})
    assert r["reference_gap"] == 0.0 and r["policy_gap"] > 0  # the reference's weights ran, not the policy's
    assert r["weights_back"] and r["logprobs_back"]


@pytest.mark.slow
def test_a_run_with_the_reference_on_the_host_is_the_run_with_a_reference_of_its_own(tmp_path):
    """``megarl train`` (``configs/tiny_cpu.yaml``, KL to the reference) twice from the same model: the host
    reference's run logs the same KL and policy loss each step, saves ``reference/`` and resumes from it."""
    import json
    import subprocess
    import sys

    from helpers.scripts import ROOT

    def train(host: str, steps: int) -> list:
        run = tmp_path / f"run-{host}"
        cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/tiny_cpu.yaml", "algo.kl_coef=0.05",
               f"trainer.reference_on_host={host}", f"train.steps={steps}", "train.save_every=1",
               f"train.run_dir={run}", f"model.path={tmp_path / 'model'}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                              env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return [(r["step"], r["loss/kl_ref"], r["loss/policy"]) for r in rows if "loss/kl_ref" in r]

    resident, host = train("false", 2), train("true", 2)
    assert host == resident and len(host) == 2 and all(kl > 0 for _, kl, _ in host)
    assert (tmp_path / "run-true" / "checkpoints" / "step_000002" / "reference").is_dir()
    assert [s for s, _, _ in train("true", 3)] == [1, 2, 3]  # resumed at step 2 from its reference/
