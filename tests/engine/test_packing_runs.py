"""``trainer.packing`` changes what the trainer computes with, not what it computes: two deterministic ``megarl
train`` runs of the tiny model, one packed with token-balanced micro-batches and one padded with row micro-batches,
log the same metrics at every step (wall-clock ones aside) to 1e-4 relative, evaluations and the warm-up included.

What differs is rounding, which Adam carries from step to step (20 warm-up steps at lr 3e-3 come first): measured,
every metric within 3.4e-5 relative but the gaps between two logprobs of a token — ``loss/approx_kl`` (the policy's
move in the step) and ``mismatch/*`` (the trainer against the engine) — whose error is the logprobs' own (~3e-6 by
step 3), not a share of the gap: ``mismatch/abs_mean`` 0.015124 against 0.015121 (1.8e-4 relative), the k3 estimates
1.4e-4 relative. Gaps are compared to 1e-5 absolute, the rest to 1e-4 relative (values within 1e-7 count as equal)."""

from __future__ import annotations

import pytest

from helpers.runs import tiny_partial_run, train
from megarl.logging.metrics import deterministic_view, read_metrics

STEPS = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from megarl.models.tiny import TinyShape, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("packing") / "model", TinyShape(family="qwen2"), seed=3)


@pytest.mark.slow  # 35 s; the default run keeps packed micro-batches' exactness (distributed/test_packing.py)
def test_packed_and_padded_runs_log_the_same_metrics(model, tmp_path):
    runs = {"packed": ["trainer.packing=true", "trainer.max_tokens_per_microbatch=128"],
            "padded": ["trainer.packing=false", "optim.micro_batch_size=16"]}
    logs = {}
    for name, keys in runs.items():
        run_dir = tmp_path / name
        # the format reward and an entropy bonus: non-zero advantages and gradients from the first step
        train(tiny_partial_run(model, run_dir, STEPS, "trainer.precision=fp32", "train.save_every=0",
                               "reward.format_coef=0.5", "algo.entropy_coef=0.01", *keys), run_dir)
        logs[name] = [deterministic_view(r) for r in read_metrics(run_dir / "metrics.jsonl")]
    packed, padded = logs["packed"], logs["padded"]
    assert [r["step"] for r in packed] == [r["step"] for r in padded] and len(packed) >= STEPS
    trained = [r for r in packed if "loss/policy" in r]
    assert len(trained) == STEPS and all(r["loss/grad_norm"] > 0 and r["loss/entropy"] > 0 for r in trained)
    assert any(r["reward/mean"] != 0 for r in trained)  # (advantages too, not only the entropy bonus)
    for a, b in zip(packed, padded):
        assert a.keys() == b.keys(), (a["step"], a.keys() ^ b.keys())
        for key, value in b.items():
            gap = key == "loss/approx_kl" or key.startswith("mismatch/")
            tolerance = dict(abs=1e-5) if gap else dict(rel=1e-4, abs=1e-7)
            assert a[key] == pytest.approx(value, **tolerance), (a["step"], key)
