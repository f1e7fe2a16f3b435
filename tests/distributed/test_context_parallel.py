"""Context parallelism (``parallel.cp``) computes what one process computes, on packed rows.

At each layout (CP 2 on 2 processes, dense and MoE with routing replay; EP 2 over the CP ranks; at 4 processes
TP 2 + SP × CP 2, DP 2 × CP 2 and PP 2 × CP 2) one worker run (tests/workers/context_parallel_checks.py) builds a
packed trainer from the same weights as a one-process run and gives it the same batch (rows of 1 to 24 positions: rows
shorter than 2·CP, a row as long as the token budget) over three optimizer steps, one per loss aggregation (GSPO's
ratio reads whole rows): the logprobs (a critic's values), every step's loss, grad norm and metrics and the weights
after one step agree to 1e-5 (fp32). DP 2 × CP 2 agreeing is the loss normalisation's proof: megatron multiplies
each micro-batch's loss by CP and averages the gradients over DP × CP.
"""

import pytest
import torch

from helpers.scripts import run_script
from megarl.models.tiny import TinyShape, make_tiny_model

SLOW = pytest.mark.slow
_RUNS: dict = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("context_parallel")
    return {f: make_tiny_model(root / f, TinyShape(family=f), seed=3) for f in ("qwen2", "qwen3_moe")}


def run(models, tmp_path_factory, family, layout, head="lm", logprobs="full", nproc=2):
    key = (family, layout, head, logprobs)
    if key not in _RUNS:
        out = tmp_path_factory.mktemp("cp_out") / f"{family}_{layout}_{head}_{logprobs}.pt"
        launcher = [] if layout == "single" else ["-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc-per-node={nproc}"]
        info = run_script([*launcher, "tests/workers/context_parallel_checks.py", layout, str(models[family]),
                           str(out), head, logprobs], env={"OMP_NUM_THREADS": "1"})
        _RUNS[key] = info, torch.load(out)
    return _RUNS[key]


def assert_same_as_one_process(got, ref, rel=1e-5):
    mask = ref["mask"]
    gap = ((got["logprobs"] - ref["logprobs"]).abs() * mask).max() / (ref["logprobs"].abs() * mask).max()
    assert gap <= rel, float(gap)
    for i, (step, want) in enumerate(zip(got["steps"], ref["steps"])):
        assert step.keys() == want.keys(), i
        for key, value in want.items():
            assert step[key] == pytest.approx(value, rel=rel, abs=1e-7), (i, key)
    assert ref["steps"][0]["grad_norm"] > 0.01  # (the steps move the weights: not vacuous)
    for name, w in ref["weights"].items():
        assert float((got["weights"][name] - w).abs().max() / w.abs().max().clamp(min=1e-2)) <= rel, name


CASES = [("qwen3_moe", "cp2", "lm", "full", 2),
         pytest.param("qwen2", "cp2", "lm", "full", 2, marks=SLOW),
         pytest.param("qwen2", "cp2", "lm", "chunk", 2, marks=SLOW),  # optim.logprob_chunk: from hidden states
         pytest.param("qwen2", "cp2", "value", "full", 2, marks=SLOW),  # the critic's values
         pytest.param("qwen3_moe", "ep2_cp2", "lm", "full", 2, marks=SLOW),  # the expert group spans the CP ranks
         pytest.param("qwen3_moe", "dp2_cp2", "lm", "full", 4, marks=SLOW),
         pytest.param("qwen2", "tp2_sp_cp2", "lm", "chunk", 4, marks=SLOW),
         pytest.param("qwen2", "pp2_cp2", "lm", "full", 4, marks=SLOW)]


@pytest.mark.parametrize("family,layout,head,logprobs,nproc", CASES)
def test_context_parallel_equals_one_process(models, tmp_path_factory, family, layout, head, logprobs, nproc):
    info, got = run(models, tmp_path_factory, family, layout, head, logprobs, nproc)
    _, ref = run(models, tmp_path_factory, family, "single", head, logprobs)
    assert info["world"] == nproc and info["cp"] == 2
    assert min(info["lengths"]) < 2 * info["cp"]  # a row shorter than 2·CP: padded, not refused
    if family == "qwen3_moe" and head == "lm":  # routing replay: the engine's routes were replayed, chunk by chunk
        assert "moe/route_agreement" in ref["steps"][0] and info["route_agreement"] is not None
    assert_same_as_one_process(got, ref)


@pytest.mark.slow
def test_rl_run_at_cp2_logs_what_cp1_logs(tmp_path):
    """``megarl train --nproc 2`` on the tiny MoE config (colocated engines, routing replay, a warm-up step, two RL
    steps with a reward that varies between samples): at ``parallel.cp=2`` every logged non-timing metric equals the
    CP 1 (DP 2) run's to 1e-4."""
    import json
    import subprocess
    import sys

    from helpers.scripts import ROOT, worker_env

    def train(cp: int) -> list[dict]:
        run_dir = tmp_path / f"cp{cp}"
        cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/tiny_cpu.yaml", "--nproc", "2",
               f"parallel.cp={cp}", "warmup.steps=1", "train.steps=2", f"train.run_dir={run_dir}",
               f"model.path={tmp_path / 'model'}", "reward.fn=helpers.reward_fns:character_variety"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=ROOT,
                              env=worker_env({"OMP_NUM_THREADS": "1"}))
        assert proc.returncode == 0, proc.stderr[-4000:]
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    ref, got = train(1), train(2)
    timing = ("timing/", "rollout/tokens_per_s", "rollout/useful_tokens_per_s", "rollout/eta_gen",
              "rollout/bubble_ratio", "sync/peak_extra_mib", "sync/backup_mib")
    assert len(got) == len(ref)
    compared = 0
    for want, have in zip(ref, got):
        for key, value in want.items():
            if not key.startswith(timing):
                assert have[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (want["step"], key)
                compared += 1
    assert compared > 50 and any(m.get("loss/grad_norm", 0) > 0 for m in ref)  # (the RL steps trained)
