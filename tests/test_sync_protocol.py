"""The named weight-sync protocol with the real parts: megatron-core (gloo) → a colocated vLLM CPU engine.

A sync whose stream breaks after half of its buckets leaves the engine serving exactly the old
weights (same greedy tokens, logprobs equal bit for bit, version unchanged); a full sync then
runs the stages in order and the audit finds engine ≈ trainer, and a skipped sync is caught.
"""

from __future__ import annotations

import pytest

from conftest import run_script
from megarl.models.tiny import TinyShape, make_tiny_model


def run_protocol(tmp_path, family: str) -> dict:
    model = make_tiny_model(tmp_path / family, TinyShape(family=family), seed=3)
    return run_script(["tests/protocol_checks.py", str(model)], env={"OMP_NUM_THREADS": "1"})


def check(r: dict) -> None:
    assert 0 < r["tensors_fed"] and r["buckets"] > 4  # the stream really broke half-way through
    assert r["failed"]["sync/failures"] == 1.0 and r["failed"]["engine/version"] == 0.0
    assert r["failed_stages"] == ["pause", "stream+load", "resume"]
    assert "engine still serves version 0" in r["log"][0]
    assert r["same_tokens"] and r["logprob_diff_after_failure"] == 0.0  # the old weights, exactly: never a mix
    assert r["ok"]["engine/version"] == 1.0 and r["ok"]["sync/failures"] == 1.0
    assert r["ok_stages"] == ["pause", "stream+load", "reset_prefix_cache", "bump_version", "resume", "audit"]
    assert r["ok"]["sync/logprob_gap"] <= 1e-4 and r["gap_synced"] <= 1e-4
    assert r["gap_skipped"] > 1e-2  # the audit catches an engine that did not get the step's weights
    assert 0 < r["ok"]["sync/backup_mib"] < 64  # the rollback copy: weights only, never the KV cache


def test_interrupted_sync_leaves_old_weights_moe(tmp_path):
    check(run_protocol(tmp_path, "qwen3_moe"))


@pytest.mark.slow
def test_interrupted_sync_leaves_old_weights_dense(tmp_path):
    check(run_protocol(tmp_path, "qwen2"))
