"""Disaggregated engines at cluster scale: several trainer processes, dead replicas, the NCCL transport.

- The wire format between processes (``tests/workers/transfer_checks.py``): two trainer senders, each on
  its own group, interleaved buckets (as pipeline stages with virtual stages send them), two
  receivers; a sender that aborts half-way does not stop the other one's buckets.
- Two trainer processes (torchrun, PP=2) → two vLLM replicas in processes of their own
  (``tests/workers/cluster_checks.py``): each pipeline stage sends its own layers, the replicas' logprobs
  equal the trainer's after every sync; a replica SIGKILLed mid-broadcast fails the sync without
  a hang, and the keeper restarts the replicas at the next phase.
- Two trainer processes at TP=2 (dense Qwen2; a transformers-written Qwen3 with a tied LM head),
  PP=2×VPP=2 (the tied Qwen3), EP=2 (Qwen3-MoE with two replicas; Mixtral) and DP=2 (dense), TP=2
  into a replica at engine TP=2, and four at TP=2×PP=2 (dense), EP=2×PP=2 and EP=2×TP=2 (Qwen3-MoE)
  → disaggregated replicas (``cluster_checks.py layout``, all ``slow``: each starts vLLM): after a
  warm-up and three RL steps every replica's logprobs equal the trainer's (fp32, ≤ 1e-4; each sync
  had work to do), and the senders are exactly the ranks that own the buckets: each rank sent the
  bytes of its own layers / experts, packed only those, and gathered nothing it does not send (at
  TP=2 each tensor is gathered onto the TP leader, which sends; its peer only gives its shard; at
  TP=2×PP=2 the senders are exactly the TP leaders of the two stages).
- ``sync.transport: nccl``: refused without CUDA, before anything starts; over NCCL on a GPU.
"""

from __future__ import annotations

import re

import pytest
import torch

from helpers.scripts import run_script


def check_wire(r: dict, abort: bool) -> None:
    assert r["exit"] == [0, 0, 0, 0]
    if not abort:
        assert r["senders"]["0"] == {"sent": 4 * (5 + 3 + 13), "error": ""}
        assert r["senders"]["1"] == {"sent": 4 * (7 + 11 + 2), "error": ""}
        for rec in r["receivers"].values():
            assert rec["error"] == "" and rec["received"] == 4 * 41
            assert rec["equal"] == {str(i): True for i in range(6)}  # each bucket, bit for bit, from its sender
        return
    assert "injected" in r["senders"]["1"]["error"] and r["senders"]["0"]["error"] == ""
    assert r["senders"]["0"]["sent"] == 4 * (5 + 3 + 13)  # sender 0 got all of its buckets through
    for rec in r["receivers"].values():
        assert rec["error"] == "TransferAborted: trainer sender 1 aborted the weight update"
        assert rec["equal"] == {"0": True, "1": True, "2": True}  # then nothing more is loaded


@pytest.mark.slow
def test_two_senders_interleaved_and_one_aborting_over_gloo():
    check_wire(run_script(["tests/workers/transfer_checks.py", "gloo", "abort"], timeout=600,
                          env={"OMP_NUM_THREADS": "1"}), abort=True)


@pytest.mark.slow
def test_two_senders_interleaved_over_gloo():
    check_wire(run_script(["tests/workers/transfer_checks.py", "gloo"], timeout=600, env={"OMP_NUM_THREADS": "1"}),
               abort=False)


@pytest.mark.gpu
def test_two_senders_over_nccl():
    if torch.cuda.device_count() < 4:
        pytest.skip("gpu: the NCCL wire test needs 4 GPUs (one per process)")
    check_wire(run_script(["tests/workers/transfer_checks.py", "nccl"], timeout=600), abort=False)
    check_wire(run_script(["tests/workers/transfer_checks.py", "nccl", "abort"], timeout=600), abort=True)


def test_nccl_transport_and_replica_devices_are_refused_without_cuda():
    from megarl.config import load_config, validate
    from megarl.config.loader import ConfigError

    if torch.cuda.is_available():
        pytest.skip("CUDA is present: nccl is allowed")
    cfg = load_config("configs/demo.yaml", ["engine.placement=disaggregated", "sync.transport=nccl"])
    with pytest.raises(ConfigError, match=r"sync.transport=nccl needs CUDA .*use sync.transport=gloo"):
        validate(cfg, 2)
    with pytest.raises(ConfigError, match=r"sync.transport must be one of 'gloo', 'nccl'; got 'tcp'"):
        validate(load_config("configs/demo.yaml", ["engine.placement=disaggregated", "sync.transport=tcp"]), 1)
    with pytest.raises(ConfigError, match=r"engine.replica_devices='0,1' names CUDA devices, but CUDA is absent"):
        validate(load_config("configs/demo.yaml", ["engine.placement=disaggregated", "engine.replica_devices=0,1"]), 1)
    with pytest.raises(ConfigError, match=r"engine.replica_devices='0,1' places disaggregated replicas; colocated"):
        validate(load_config("configs/demo.yaml", ["engine.replica_devices=0,1"]), 1)  # (ignored on a GPU, silently)
    validate(load_config("configs/demo.yaml", ["engine.placement=disaggregated", "engine.replicas=2"]), 2)  # 2 trainers
    validate(load_config("configs/demo.yaml", ["engine.placement=disaggregated", "engine.tensor_parallel_size=2"]), 1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    run = tmp_path_factory.mktemp("cluster")
    out = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                      "tests/workers/cluster_checks.py", str(run)], timeout=1200, env={"OMP_NUM_THREADS": "1"})
    return out["ranks"]


def test_two_trainer_processes_each_send_their_own_stage_and_the_replicas_match(cluster):
    for rank, r in enumerate(cluster):
        assert r["senders"] == [0, 1], rank  # PP=2: both stages send; nobody gathers the other's layers
        assert all(n > 0 for n in r["sent_by_rank"]) and sum(r["sent_by_rank"]) == r["steps"][0]["sync/bytes"]
        assert [m["engine/version"] for m in r["steps"]] == [1.0, 2.0], rank
        assert all(m["sync/logprob_gap"] <= 1e-4 for m in r["steps"]), rank  # the audit after every sync
        assert r["steps"][0]["sync/peak_extra_mib"] < r["steps"][0]["sync/bytes"] / 2**20 / 4


def test_a_replica_killed_mid_broadcast_fails_the_sync_then_the_keeper_restarts_them(cluster):
    for rank, r in enumerate(cluster):
        assert r["killed"] == {"sync/failures": 1.0, "engine/version": 2.0}, rank  # the old version, not a mix
        assert r["killed_s"] < 60, rank  # no hang: the watchdog ended the replicas, every link failed at once
        assert r["restarts"] == 1 and r["after"]["engine/version"] == 4.0, rank
        assert r["after"]["sync/logprob_gap"] <= 1e-4 and max(r["gaps"]) <= 1e-4 and r["versions"] == [4, 4], rank
    assert cluster[0]["alive_after_kill"] == [False, False]  # the broken group's replicas were all ended


@pytest.mark.slow
def test_one_replica_at_tp2_matches_the_trainer_and_survives_a_broken_sync(tmp_path):
    r = run_script(["tests/workers/cluster_checks.py", "replica_tp", str(tmp_path)], timeout=1200,
                   env={"OMP_NUM_THREADS": "1"})
    assert r["versions"] == [1.0, 2.0] and max(r["gaps"]) <= 1e-4  # both TP workers loaded their shards
    assert r["failed"]["sync/failures"] == 1.0 and r["failed"]["engine/version"] == 2.0
    assert "replicas serve versions [2]" in r["log"][0]
    assert r["ok"]["engine/version"] == 3.0 and r["ok"]["sync/logprob_gap"] <= 1e-4


@pytest.mark.slow
def test_megarl_train_two_trainer_processes_two_replicas_end_to_end(tmp_path):
    import subprocess
    import sys

    from helpers.scripts import ROOT

    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/demo.yaml", "--nproc", "2",
           "parallel.pp=2", "warmup.steps=2", "train.steps=2", "train.time_limit_s=0",
           f"train.run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}", "data.eval_size=4",
           "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "engine.slots=8",
           "engine.kv_cache_gib=0.0625", "engine.placement=disaggregated", "engine.replicas=2", "rollout.mode=partial",
           "sync.check_every=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step 2/2 |" in proc.stdout and "eval after RL: pass@1" in proc.stdout


# layout id → (trainer layout, engine replicas, cluster_checks.py overrides); tiny models of 4 layers, 4 experts
LAYOUTS = {
    "tp2_dense": (dict(tp=2), 1, ("parallel.tp=2", "model.make_tiny=qwen2")),
    "pp2_vpp2_tied": (dict(pp=2, vpp=2), 1, ("parallel.pp=2", "parallel.vpp=2", "hf=qwen3_tied")),
    "tp2_tied": (dict(tp=2), 1, ("parallel.tp=2", "hf=qwen3_tied")),
    "ep2_qwen3_moe": (dict(ep=2), 2, ("parallel.ep=2", "engine.replicas=2")),
    "ep2_mixtral": (dict(ep=2), 1, ("parallel.ep=2", "model.make_tiny=mixtral")),
    "dp2_dense": (dict(), 1, ("model.make_tiny=qwen2",)),
    # a replica at engine TP=2 (two vLLM workers in the transfer group) fed by a trainer at TP=2
    "tp2_dense_engine_tp2": (dict(tp=2), 1,
                             ("parallel.tp=2", "model.make_tiny=qwen2", "engine.tensor_parallel_size=2")),
    # combined layouts: four trainer processes
    "tp2_pp2_dense": (dict(tp=2, pp=2, world=4), 1, ("parallel.tp=2", "parallel.pp=2", "model.make_tiny=qwen2")),
    "ep2_pp2_qwen3_moe": (dict(ep=2, pp=2, world=4), 1, ("parallel.ep=2", "parallel.pp=2")),
    "ep2_tp2_qwen3_moe": (dict(ep=2, tp=2, etp=1, world=4), 1,
                          ("parallel.ep=2", "parallel.tp=2", "parallel.etp=1", "parallel.sequence_parallel=true")),
    # expert TP = 2: the experts' shards gathered over the expert TP group; megatron's alltoall dispatcher
    # all-gathers uneven token counts there, which gloo refuses, so the trainer runs allgather (trainer/parallel.py)
    "ep2_tp2_etp2_qwen3_moe": (dict(ep=2, tp=2, etp=2, world=4), 1,
                               ("parallel.ep=2", "parallel.tp=2", "parallel.etp=2", "parallel.sequence_parallel=true")),
}


def owner(name: str, tp: int = 1, pp: int = 1, vpp: int = 1, ep: int = 1, world: int = 2, etp: int = 0,
          layers: int = 4, experts: int = 4) -> int:
    """The trainer rank that holds a Megatron tensor's layer or expert and must send it: the TP leader (of the
    first DP replica) of its (virtual) chunk's pipeline stage, offset by its expert rank × expert TP (0: = TP) for
    an expert. Megatron's rank order is tp-dp-pp: a stage's ranks are ``[stage·world/pp, (stage+1)·world/pp)``."""
    layer = re.match(r"decoder\.layers\.(\d+)\.", name)
    if layer is None:
        stage = pp - 1 if name.startswith(("decoder.final_layernorm.", "output_layer.")) else 0
    else:
        stage = int(layer.group(1)) // (layers // (pp * vpp)) % pp
    base = stage * (world // pp)
    expert = re.search(r"\.experts\.local_experts\.(\d+)\.", name)
    if expert is not None and ep > 1:
        return base + int(expert.group(1)) // (experts // ep) * (etp or tp)
    return base


def check_layout(r: dict, layout: dict, replicas: int, tied: bool) -> None:
    steps, plan = r["steps"], r["plan"]
    assert [m["engine/version"] for m in steps] == [1.0, 2.0, 3.0] and r["versions"] == [3] * replicas
    assert min(m["loss/grad_norm"] for m in steps) > 0 and min(r["stale"]) > 1e-3  # every sync had work to do
    assert max(m["sync/logprob_gap"] for m in steps) <= 1e-4  # the audit after every sync
    assert len(r["gaps"]) == replicas and max(r["gaps"]) <= 1e-4  # and each replica at the end
    for name, source, _ in plan:
        assert source == owner(name, **layout), name
    world, tp = layout.get("world", 2), layout.get("tp", 1)
    assert len(r["ranks"]) == world
    own = [sorted(n for n, s, _ in plan if s == k) for k in range(world)]
    expected = [sum(b for _, s, b in plan if s == k) for k in range(world)]
    assert sum(expected) == steps[-1]["sync/bytes"] == steps[-1]["sync/sent_bytes"]
    for k, x in enumerate(r["ranks"]):
        assert x["senders"] == [j for j in range(world) if expected[j]], k  # exactly the ranks that own buckets
        assert x["sent_by_rank"] == expected, k  # each sent the bytes of its own buckets, nothing else
        assert x["wrote"] == own[k] and set(x["wrote"]) <= set(x["local"]), k  # nobody packs what it does not own
        assert set(x["gathered"]) <= set(own[k]), k  # nor gathers it
        if not expected[k]:
            assert x["peak_extra"] == 0, k  # a rank that sends nothing holds no bucket and no gathered tensor
    for k, x in enumerate(r["ranks"]):
        if tp == 1:
            assert x["gathered"] == x["gave"] == [], k  # no TP: no gather
        elif k % tp == 0:  # the per-tensor TP gather onto the leader, which sends
            assert x["gave"] == [] and bool(x["gathered"]) == bool(expected[k]), k
        else:  # its peer only gives its shard of each tensor its leader gathered
            assert x["gathered"] == [] and x["gave"] == r["ranks"][k - k % tp]["gathered"], k
    assert r["tied"] == tied
    if tied:  # the head is the embedding: not sent again (at PP > 1 though the last stage holds a copy)
        assert not any(n.startswith("output_layer.") for n, _, _ in plan)
        if layout.get("pp", 1) > 1:
            assert "output_layer.weight" in r["ranks"][-1]["local"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_trainer_processes_at_each_layout_feed_disaggregated_replicas(tmp_path, name):
    layout, replicas, overrides = LAYOUTS[name]
    r = run_script(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={layout.get('world', 2)}",
                    "tests/workers/cluster_checks.py",
                    "layout", str(tmp_path), *overrides], timeout=1200, env={"OMP_NUM_THREADS": "1"})
    check_layout(r, layout, replicas, tied="tied" in name)
    if layout.get("ep", 1) > 1:  # megarl's default alltoall, but allgather at expert TP > 1 on gloo
        etp = layout.get("etp", layout.get("tp", 1))
        assert r["dispatcher"] == ("allgather" if etp > 1 else "alltoall")
        # expert TP > 1: each expert's shards gathered onto its expert-TP leader (only there); 1: never split
        experts = {n for x in r["ranks"] for n in x["gathered"] if ".local_experts." in n}
        assert experts == ({n for n, _, _ in r["plan"] if ".local_experts." in n} if etp > 1 else set())
        assert bool(experts) == (etp > 1)
