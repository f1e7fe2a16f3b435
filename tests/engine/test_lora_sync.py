"""LoRA's adapter-only sync into colocated vLLM engines and replica processes (megarl/weight_sync/adapters.py,
megarl/engines/adapters.py, megarl/engines/remote/) with the real parts: a megatron-core trainer with adapters →
vLLM's CPU engine serving them as LoRA adapters loaded from tensors in memory, under the sync protocol's
all-or-nothing rule and audit, in flight too; and `megarl train` with LoRA."""

from __future__ import annotations

import pytest

from helpers.runs import scalars, tiny_partial_run, train
from helpers.scripts import run_script
from megarl.models.tiny import TinyShape, make_tiny_model


def check(r: dict) -> None:
    assert r["gap_base"] > 1e-2  # the trained adapters change the model: an engine without them is caught
    # a broken adapter (one rank's B a row short) is refused on every rank: the base still served, exactly
    assert r["failed"]["sync/failures"] == 1.0 and r["failed"]["engine/version"] == 0.0
    assert "shape" in r["log"][0] and "engine still serves version 0" in r["log"][0]
    assert r["same_tokens"] and r["logprob_diff_after_failure"] == 0.0
    assert r["ok"]["engine/version"] == 1.0 and r["ok"]["sync/logprob_gap"] <= 1e-4  # the audit: engine ≈ trainer
    assert r["gap_skipped"] > 1e-2  # a skipped sync is caught by the audit
    assert r["again"]["engine/version"] == 2.0 and r["again"]["sync/logprob_gap"] <= 1e-4
    assert r["second_id"] != r["first_id"] and r["held"] == [r["second_id"]]  # a new adapter id; the old one gone
    # only the adapters move: rank 4 on the tiny model's 128-wide layers is ~5% of its weights
    assert 0 < r["ok"]["sync/bytes"] < 0.06 * r["full_bytes"]


def test_adapter_sync_all_or_nothing_and_audited(tmp_path):
    model = make_tiny_model(tmp_path / "qwen2", TinyShape(family="qwen2"), seed=3)
    check(run_script(["tests/workers/lora_sync_checks.py", str(model)], env={"OMP_NUM_THREADS": "1"}))


@pytest.mark.slow  # (2 processes: trainer TP 2 with sequence parallelism, one engine at TP 2)
def test_adapter_sync_at_tensor_parallel_2(tmp_path):
    model = make_tiny_model(tmp_path / "qwen2", TinyShape(family="qwen2"), seed=3)
    check(run_script(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                      "tests/workers/lora_sync_checks.py", str(model), "tp2"], env={"OMP_NUM_THREADS": "1"}))


@pytest.mark.slow  # (the dense test above is its fast representative)
def test_adapter_sync_into_an_moe_engine_on_cpu_wraps_attention_alone(tmp_path):
    """The tiny Qwen3-MoE, adapters on attention: the engine wraps those modules alone for LoRA (vLLM's
    ``lora_target_modules``), so its MoE layers keep their CPU kernel, and the sync is served as on a dense model."""
    model = make_tiny_model(tmp_path / "moe", TinyShape(family="qwen3_moe"), seed=3)
    check(run_script(["tests/workers/lora_sync_checks.py", str(model), "moe"], env={"OMP_NUM_THREADS": "1"}))


@pytest.mark.slow  # (an engine start and a trainer)
def test_adapters_on_every_expert_are_served_by_a_cpu_engine_all_or_nothing_and_audited(tmp_path):
    """Adapters on attention and every routed expert (``lora.targets`` …,experts) of the tiny Qwen3-MoE: the engine
    wraps its fused-MoE layers for LoRA (on CPU through ``compat.vllm_moe_lora``), an adapter missing one expert is
    refused, the sync then serves the trainer's logprobs, each expert's A and B sit in that expert's slot of vLLM's
    stacked tensors exactly, and the experts' adapters are part of what it serves."""
    model = make_tiny_model(tmp_path / "moe", TinyShape(family="qwen3_moe"), seed=3)
    r = run_script(["tests/workers/lora_expert_engine_checks.py", str(model)], env={"OMP_NUM_THREADS": "1"})
    assert r["gap_base"] > 1e-2  # the engine still serves the base: the audit catches it
    assert r["failed"]["sync/failures"] == 1.0 and r["failed"]["engine/version"] == 0.0
    assert "experts.gate_proj is not whole" in r["log"][0] and "missing [(1, 2)]" in r["log"][0]
    assert r["ok"]["engine/version"] == 1.0 and r["ok"]["sync/logprob_gap"] <= 1e-4  # measured 4.8e-7
    assert r["tensors"] == 4 * 4 * 2 + 4 * 4 * 3 * 2  # q, k, v, o; every expert's gate, up, down (A and B each)
    assert r["expert_linears"] == 4 * 4 * 2 and r["slot_gap"] == 0.0 and r["b_moved"] > 1e-3
    assert r["gap_without_experts"] > 1e-2  # measured 0.053: the engine runs the experts' adapters


def check_replica(r: dict) -> None:
    assert r["gap_base"] > 1e-2  # the replica still serves the base: the audit catches it
    # a broken adapter is refused by the replica: the base still served, exactly; the failure counted
    assert r["failed"]["sync/failures"] == 1.0 and r["failed"]["engine/version"] == 0.0
    assert "shape" in r["log"][0] and "still serves the previous one" in r["log"][0]
    assert r["same_tokens"] and r["logprob_diff_after_failure"] == 0.0
    assert r["ok"]["engine/version"] == 1.0 and r["ok"]["sync/logprob_gap"] <= 1e-4  # the audit: replica ≈ trainer
    assert 0 < r["ok"]["sync/bytes"] == r["ok"]["sync/sent_bytes"] < 0.06 * r["full_bytes"]  # the adapters alone
    f, grown = r["flight"], r["flight"]["grown"]
    assert f["report"]["sync/in_flight"] == 1.0 and f["report"]["engine/version"] == 2.0
    assert 0 < grown < len(f["tokens"]) and f["versions"] == [1] * grown + [2] * (len(f["tokens"]) - grown)
    assert f["tokens"][:grown] == r["v1_tokens"][:grown]  # version 1's tokens up to the load
    # after it, exactly what the idle replica serving version 2 gives from the tokens so far (KV recomputed under
    # the new adapter), and not version 1's
    assert f["tokens"][grown:] == r["idle_tokens"] and f["logprobs"][grown:] == pytest.approx(r["idle_logprobs"],
                                                                                             abs=1e-5)
    assert max(abs(a - b) for a, b in zip(f["logprobs"][grown:], r["v1_logprobs"][grown:])) > 1e-2
    assert r["gap_v2"] <= 1e-4
    # a dead replica: the sync fails, every replica ended for the next phase to restart, nothing hangs
    assert r["died"]["sync/failures"] == 2.0 and "every replica was ended" in r["log"][-1]


def test_adapter_sync_into_a_replica_process_all_or_nothing_in_flight_and_audited(tmp_path):
    model = make_tiny_model(tmp_path / "qwen2", TinyShape(family="qwen2"), seed=3)
    check_replica(run_script(["tests/workers/lora_replica_checks.py", str(model)], env={"OMP_NUM_THREADS": "1"}))


@pytest.mark.slow  # (the replica's two workers in processes of their own: the adapters cross vLLM's RPC to each)
def test_adapter_sync_into_a_replica_at_tensor_parallel_2(tmp_path):
    model = make_tiny_model(tmp_path / "qwen2", TinyShape(family="qwen2"), seed=3)
    check_replica(run_script(["tests/workers/lora_replica_checks.py", str(model), "2"], env={"OMP_NUM_THREADS": "1"}))


@pytest.mark.slow  # (a `megarl train` run with a replica process, ~40 s)
def test_train_with_lora_on_a_replica_with_async_overlap(tmp_path):
    """`megarl train` with LoRA, a disaggregated replica and async overlap: every sync moves the adapters alone and
    passes the audit, every trained token within the staleness bound (whether a sync lands in flight depends on the
    phases' and steps' timings here: the in-flight load itself is the worker test's, deterministic)."""
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    train(tiny_partial_run(tmp_path / "model", run_dir, 6, "model.make_tiny=qwen2", "lora.rank=4", "lora.alpha=8",
                           "engine.placement=disaggregated", "rollout.overlap=async", "rollout.staleness_limit=2",
                           "train.save_every=0", "sync.check_every=1"), run_dir)
    s = scalars(run_dir)
    assert s["engine/version"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] and max(s["sync/failures"]) == 0
    assert 1 <= max(s["rollout/staleness_max"]) <= 2  # generation ran ahead of training, within the bound
    assert max(s["sync/logprob_gap"]) <= 1e-4  # the warm-up moved the adapters: a replica without them is caught
    weights = sum(t.numel() * 4 for t in load_file(tmp_path / "model" / "model.safetensors").values())
    assert 0 < max(s["sync/bytes"]) < 0.06 * weights


@pytest.mark.slow  # (a `megarl train` run, ~1 min; the worker test above is its fast representative)
def test_train_with_lora_syncs_the_adapters_and_refers_to_the_base(tmp_path):
    """`megarl train` with LoRA: every step's sync moves the adapters alone and the audit finds engine ≈ trainer; the
    KL reference is the policy's base (no learner of its own in the checkpoint); the export is a PEFT adapter."""
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    train(tiny_partial_run(tmp_path / "model", run_dir, 2, "model.make_tiny=qwen2", "lora.rank=4", "lora.alpha=8",
                           "sync.check_every=1", "algo.kl_coef=0.01"), run_dir)
    s = scalars(run_dir)
    assert s["engine/version"] == [1.0, 2.0]
    assert max(s["sync/logprob_gap"]) <= 1e-4
    weights = sum(t.numel() * 4 for t in load_file(tmp_path / "model" / "model.safetensors").values())
    assert 0 < max(s["sync/bytes"]) < 0.06 * weights
    assert min(s["loss/kl_ref"]) > 0  # the warm-up trained the adapters: the policy is no longer its base
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step_000002").iterdir() if p.is_dir()) == [
        "policy", "rng"]  # the reference is the policy with its adapters off: nothing of its own to save
    adapter = load_file(run_dir / "hf" / "step_2" / "adapter_model.safetensors")
    assert any(float(t.abs().max()) > 0 for n, t in adapter.items() if "lora_B" in n)


@pytest.mark.slow  # (three `megarl train` runs, ~4 min)
def test_kill_9_and_resume_with_lora_is_exact(tmp_path):
    """kill -9 during step 3's generation, resumed by the same command: the adapters and their optimizer state come
    back from the run checkpoint, the engines are sent them again, and every non-timing metric is the uninterrupted
    run's (the entropy bonus and the KL to the base move the adapters every step; the dropout's masks come from
    megatron's RNG tracker, whose states the checkpoint holds)."""
    import signal

    from megarl.logging.metrics import deterministic_view, read_metrics

    model = make_tiny_model(tmp_path / "model", TinyShape(family="qwen2"), seed=3)
    args = ("lora.rank=4", "lora.alpha=8", "lora.dropout=0.1", "algo.entropy_coef=0.01", "algo.kl_coef=0.01",
            "sync.check_every=1")
    runs = {name: tmp_path / name for name in ("baseline", "killed")}
    train(tiny_partial_run(model, runs["baseline"], 4, *args), runs["baseline"])
    train(tiny_partial_run(model, runs["killed"], 4, *args), runs["killed"],
          env={"MEGARL_TEST_KILL": "engine_step@3:3"}, rc=-signal.SIGKILL)
    assert read_metrics(runs["killed"] / "metrics.jsonl")[-1]["step"] == 2
    out = train(tiny_partial_run(model, runs["killed"], 4, *args), runs["killed"])
    assert "resumed from" in out
    base, got = (read_metrics(runs[n] / "metrics.jsonl") for n in ("baseline", "killed"))
    assert any(r.get("loss/grad_norm", 0) > 0 for r in base)  # the adapters move
    assert [deterministic_view(r) for r in got] == [deterministic_view(r) for r in base]
    assert max(scalars(runs["killed"])["sync/logprob_gap"]) <= 1e-4
