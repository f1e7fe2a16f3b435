"""Colocated engine replicas: engine TP smaller than the world gives world/TP replicas in the trainer's
processes, each generating its own share of one controller's shared pull queue, in lockstep.

Real parts: megatron-core over gloo (2 processes, trainer TP 2), two vLLM CPU engines (TP 1, one
per rank), the run's own ``build_session`` and ``rl_step`` in partial mode (``colocated_checks.py``).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from helpers.scripts import ROOT, run_script


def run_checks(tmp_path_factory, nproc: int = 2, *overrides: str) -> dict:
    run = tmp_path_factory.mktemp("coloc")
    return run_script(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                       "tests/workers/colocated_checks.py", str(run), *overrides], env={"OMP_NUM_THREADS": "1"},
                      timeout=1200)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_checks(tmp_path_factory)


def check_replicas_match_the_trainer(r: dict) -> None:
    assert r["replicas"] == r["world"] // r["engine_tp"] and len(r["gap_synced"]) == r["world"]
    assert min(r["gap_stale"]) > 1e-3  # the warm-up moved the trainer: every engine was really stale
    assert max(r["gap_synced"]) <= 1e-4  # after the streamed sync, every rank's engine equals the trainer
    assert min(r["grad_norms"]) > 0 and min(r["stale_before_sync"]) > 1e-4  # each RL step moved the trainer
    assert max(r["audits"]) <= 1e-4  # and after each step's sync, every rank's engine equals it again
    assert r["versions"] == [float(k + 1) for k in range(len(r["versions"]))]


def check_no_duplicated_work(r: dict) -> None:
    ranks, tp = r["ranks"], r["engine_tp"]
    leaders = [ranks[k * tp] for k in range(r["replicas"])]
    for x in ranks:  # the ranks of one replica run the same requests; the routing table is the same everywhere
        assert x["given"] == leaders[x["replica"]]["given"] and x["submitted"] == ranks[0]["submitted"]
    for x in ranks:  # evaluation: each replica its share (then the whole set on one engine, for comparison)
        n = x["eval_counts"][1]
        assert x["eval_same"] and x["eval_counts"][0] == len(range(x["replica"], n, r["replicas"])) < n
    sets = [set(x["given"]) for x in leaders]
    assert all(sets) and sum(len(s) for s in sets) == len(set().union(*sets))  # each request ran on one replica
    assert [len(s) for s in sets] == ranks[0]["submitted"][:]  # and nowhere else
    same = r["same_prompt"]
    assert all(same) and len({tuple(t) for t in same}) == len(same)  # own sampling streams per replica


def check_lockstep(r: dict) -> None:
    first = r["ranks"][0]
    assert len(first["released"]) == len(r["versions"])
    assert [x["shared_score"] for x in r["ranks"]] == [[0.0]] * r["world"]  # rewards: rank 0 scores for all
    last = r["replicas"] - 1
    for x in r["ranks"]:  # one replica's engine error is raised on every rank, so the keeper acts everywhere
        assert f"colocated engine step failed: replica {last} (rank {last * r['engine_tp']}): RuntimeError: " \
               "engine fault on purpose" in x["step_error"] and x["left"] == 0
    for x in r["ranks"][1:]:  # released groups (tokens, logprobs, versions, rewards) and the buffer, alike
        assert x["released"] == first["released"] and x["buffer"] == first["buffer"]
        for key in ("drawn", "released_ids", "live", "requeued"):
            assert x[key] == first[key], key


def check_versions_and_prompts(r: dict) -> None:
    for x in r["ranks"]:
        assert {step for step, _, _ in x["events"]} == set(range(len(r["versions"])))  # every replica generated
        for step, _, version in x["events"]:
            assert version == step  # the version of the engine that sampled it (synced to `step` before it)
    first = r["ranks"][0]
    assert set(first["drawn"]) == set(first["released_ids"]) | set(first["live"]) | set(first["requeued"])
    assert len(first["released_ids"]) >= 4 * len(r["versions"])  # prompts_per_step groups every step
    for versions in first["live_versions"]:  # partial: the buffer keeps each token's version across phases
        assert versions == sorted(versions) and set(versions) <= set(range(len(r["versions"])))


def test_each_replica_engine_matches_the_trainer_after_sync_and_training(result):
    check_replicas_match_the_trainer(result)


def test_replicas_generate_different_requests(result):
    check_no_duplicated_work(result)


def test_every_rank_releases_the_same_groups(result):
    check_lockstep(result)


def test_every_token_carries_its_engine_version_and_no_prompt_is_lost(result):
    check_versions_and_prompts(result)


@pytest.mark.parametrize("world, engine_tp, ok", [(2, 1, True), (2, 2, True), (4, 2, True), (4, 3, False),
                                                  (2, 4, False), (4, 0, False)])
def test_engine_tp_must_divide_the_world(world, engine_tp, ok):
    from megarl.config import ConfigError, load_config, validate
    from megarl.models.tiny import TinyShape, hf_config

    cfg = load_config(None, [f"engine.tensor_parallel_size={engine_tp}"])
    hf = hf_config(TinyShape(family="qwen2"), eos_id=1, pad_id=0)
    if ok:
        validate(cfg, world, hf)
        return
    valid = [d for d in range(1, world + 1) if world % d == 0]
    with pytest.raises(ConfigError, match=rf"engine.tensor_parallel_size={engine_tp} must divide the world size "
                                          rf"{world} .*; valid: {re.escape(str(valid))}"):
        validate(cfg, world, hf)


def test_plan_counts_replicas_and_refuses_an_engine_tp_that_splits_the_world():
    from helpers.plans import QWEN25_32B, RUN
    from megarl.config import ConfigError, load_config
    from megarl.launch.plan import plan

    res = plan(QWEN25_32B, load_config(None, [*RUN, "parallel.tp=8", "engine.tensor_parallel_size=4"]), 2, 8, 141)
    assert res["layout"]["engine_tp"] == 4 and res["layout"]["engine_replicas"] == 4
    with pytest.raises(ConfigError, match=r"engine.tensor_parallel_size=3 must divide the world size 16"):
        plan(QWEN25_32B, load_config(None, [*RUN, "engine.tensor_parallel_size=3"]), 2, 8, 141)
    proposed = plan(QWEN25_32B, load_config(None, RUN), 2, 8, 141, propose=True)["layout"]
    assert 16 % proposed["engine_tp"] == 0 and proposed["engine_replicas"] == 16 // proposed["engine_tp"]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("parallel.tp=1", "parallel.pp=2"),
    ("parallel.tp=1", "parallel.ep=2", "model.make_tiny=qwen3_moe"),
], ids=["pp2", "ep2_moe"])
def test_other_trainer_layouts_feed_two_replicas(tmp_path_factory, overrides):
    r = run_checks(tmp_path_factory, 2, *overrides)
    for check in (check_replicas_match_the_trainer, check_no_duplicated_work, check_lockstep,
                  check_versions_and_prompts):
        check(r)
    if "model.make_tiny=qwen3_moe" in overrides:  # routing replay: the routes go to rank 0 alone, whole
        assert all(n == total > 0 for n, total in r["ranks"][0]["routed"]), r["ranks"][0]["routed"]
        assert all(n == 0 for x in r["ranks"][1:] for n, _ in x["routed"])


@pytest.mark.slow
def test_engine_tp2_replicas_over_four_processes(tmp_path_factory):
    """vLLM's external_launcher builds TP groups of consecutive ranks: [0, 1] and [2, 3] are two replicas."""
    r = run_checks(tmp_path_factory, 4, "engine.tensor_parallel_size=2", "engine.kv_cache_gib=0.125")
    assert r["replicas"] == 2
    for check in (check_replicas_match_the_trainer, check_no_duplicated_work, check_lockstep,
                  check_versions_and_prompts):
        check(r)


@pytest.mark.slow
def test_megarl_train_with_two_colocated_replicas(tmp_path):
    """The real command: 2 processes, engine TP 1, partial mode. One replica's engine fails in step 2: every
    rank raises it after the step's exchange and recovers its engine in place; the run completes and its final
    checkpoint holds every prompt exactly once."""
    from helpers.runs import final_state, no_prompt_lost_or_twice

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/demo.yaml", "--nproc", "2",
           "model.make_tiny=qwen2", f"model.path={tmp_path / 'model'}", f"train.run_dir={run}", "parallel.tp=2",
           "engine.tensor_parallel_size=1", "rollout.mode=partial", "warmup.steps=2", "warmup.batch_size=16",
           "train.steps=2", "train.save_every=2", "train.time_limit_s=0", "data.eval_size=4", "data.max_digits=2",
           "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=24",
           "engine.max_model_len=96", "engine.slots=8", "engine.kv_cache_gib=0.25", "optim.micro_batch_size=16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "MEGARL_TEST_FAULT": "engine_error@2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "step 2/2 |" in proc.stdout and "eval after RL: pass@1" in proc.stdout
    for rank in (0, 1):
        assert re.search(rf"rank {rank} step 2: engine error mid-phase \(RuntimeError: colocated engine step failed: "
                         r".*engine fault injected.*restart 1/3", proc.stderr)  # (faults are warnings)
    state = final_state(run)
    no_prompt_lost_or_twice(state)
    for _, samples, *_ in state["controller"]["live"].values():
        for x in samples:  # tokens sampled by engines serving versions 0..2, never ahead of the run
            assert x.versions == sorted(x.versions) and set(x.versions) <= {0, 1, 2}
