"""Engine-only GPUs inside the trainer's nodes (``engine.replica_devices``, the trainer on TRAINER_GPUS_PER_NODE
processes a node): ``megarl plan``'s candidates and step time against hand calculations, the checks of the
replicas' GPUs against the trainer's and the node's, and the launch scripts that start such a job. Pure Python
and the example scripts' plan, fast."""

import json
import subprocess
import sys

import pytest

from helpers.scripts import ROOT
from megarl.config import load_config
from megarl.launch.gpus import PRESETS
from megarl.launch.layout import Layout
from megarl.launch.memory import memory_gib
from megarl.launch.model_size import count_params
from megarl.launch.plan import main, plan
from megarl.launch.ranking import ranked
from megarl.launch.step_time import step_time, work_of

LLAMA_8B = json.loads((ROOT / "examples/models/llama3.1-8b.json").read_text())
HBM, NVLINK, NETWORK = 3.35e12 * 0.7, 450e9, 50e9
# 32 prompts × 16 samples of 256 + 1024 tokens, capped at 3072 (sync mode: the longest ends last), 256 slots.
JOB = ["rollout.prompts_per_step=32", "rollout.samples_per_prompt=16", "rollout.max_new_tokens=3072",
       "engine.max_model_len=4096", "engine.slots=256", "engine.kv_cache_gib=8", "optim.micro_batch_size=1",
       "trainer.precision=bf16"]


def _plan(overrides, nodes=1, prompt=256, response=1024, **kw):
    cfg = load_config(None, [*JOB, *overrides])
    return plan(LLAMA_8B, cfg, nodes, 8, 79.6, propose=True, work=work_of(cfg, LLAMA_8B, prompt, response), **kw)


def test_the_split_inside_a_node_against_the_hand_calculation():
    """Trainer TP 4 on GPUs 0-3, one TP-4 replica on GPUs 4-7, rollout.overlap=async: max(train, rollout) + sync,
    the sync over NVLink (one node), the engine within the node."""
    cfg = load_config(None, [*JOB, "rollout.overlap=async"])
    work, counts = work_of(cfg, LLAMA_8B, 256, 1024), count_params(LLAMA_8B)
    lay = Layout(1, 4, tp=4, sequence_parallel=True, engine_tp=4, placement="disaggregated", engine_gpus=4,
                 replicas=1)
    mem = memory_gib(counts, LLAMA_8B, cfg, lay, "bf16")
    trainer_gpu = sum(mem[k] for k in ("weights", "gradients", "optimizer", "activations", "logits")) + 2
    engine_gpu = mem["engine_weights"] + mem["cuda_graphs"] + mem["kv_cache"] + 2  # apart: never both on one GPU
    assert mem["engine_weights"] == pytest.approx(counts.total * 2 / 4 / 2**30) and mem["kv_cache"] == 8
    assert mem["total"] == pytest.approx(max(trainer_gpu, engine_gpu)) and mem["total"] < trainer_gpu + engine_gpu - 2
    st = step_time(counts, LLAMA_8B, cfg, lay, PRESETS["h100"], work, mem)
    n, tokens, layers, q, h = counts.total, 512 * 1280, 32, 32 * 128, 4096
    assert st["train"]["gpus"] == 4 and st["train"]["passes"]["forwards"] == ["proximal"]  # (async: stale tokens)
    mm = n - counts.embedding  # a forward and backward, + the proximal forward: 8 FLOPs a parameter and token
    assert st["train"]["compute_s"] == pytest.approx(tokens * (8 * mm + 8 * layers * q * 1280) / (4 * 989e12 * 0.4))
    r = st["rollout"]
    kv_token = 2 * layers * (8 // 4) * 128 * 2  # K and V of 2 KV heads a rank, bf16
    batch = int(8 * 2**30 // (kv_token * 1280))  # what 8 GiB of KV cache holds at the mean full length: 204
    assert r["replicas"] == 1 and r["batch"] == batch == 204 and not r["across_nodes"]
    vocab = LLAMA_8B["vocab_size"]  # TP all-reduces and the logits' all-gather, within the node
    comm = 2 * layers * (10e-6 + batch * h * 2 * 2 * 3 / 4 / NVLINK) + 10e-6 + batch * vocab * 2 * 3 / 4 / NVLINK
    sampler = batch * vocab * 70  # the sampler's fp32 passes on every rank
    decode_step = ((n - counts.embedding) * 2 / 4 + batch * (256 + 512) * kv_token + sampler) / HBM + comm
    assert r["decode_step_s"] == pytest.approx(decode_step)
    assert r["steps"] == pytest.approx(512 * 1024 / batch + 3072 - 1024)
    refit = 0.48 + n * 2 / 4 / 19.7e9  # NeMo-RL's measured refit into each engine GPU, under NVLink's rate
    assert st["sync"]["path"] == "NVLink" and st["sync"]["transfer_s"] == pytest.approx(refit)
    assert st["overlap"] and st["step_s"] == pytest.approx(max(st["train_s"], st["rollout_s"]) + st["sync_s"])
    two = Layout(2, 4, tp=4, sequence_parallel=True, engine_tp=4, placement="disaggregated", engine_gpus=4,
                 replicas=2)  # on two nodes the replicas of the second receive over the network
    st2 = step_time(counts, LLAMA_8B, cfg, two, PRESETS["h100"], work, memory_gib(counts, LLAMA_8B, cfg, two, "bf16"))
    assert st2["sync"]["path"] == "network" and st2["sync"]["transfer_s"] == pytest.approx(refit)  # < 50 GB/s


def test_the_split_is_proposed_where_overlapping_a_decode_bound_rollout_wins_and_not_where_it_does_not():
    """Decode dominates (14 s of rollout, mostly the sync-mode tail, against 10 s of training on all 8 GPUs):
    overlapping it with training on 4 GPUs of their own beats training and generating in turn on all 8. With
    a small step (8 prompts, 512-token responses) the tail runs fastest on one TP-8 engine of all the GPUs, and
    colocated is proposed: the splits are weighed, and slower."""
    # (without the proximal forward algo.decoupled_ppo=auto adds for the stale tokens: a run may leave it off)
    split = _plan(["rollout.overlap=async", "algo.decoupled_ppo=false"])  # before: no valid layout (overlap needs
    # disaggregated replicas)
    colocated = _plan([])
    lay = split["layout"]
    assert lay["engine_gpus"] == 4 and lay["trainer_gpus_per_node"] == 4 and lay["replica_devices"] == "4,5,6,7"
    assert colocated["layout"]["placement"] == "colocated"
    assert split["step_time"]["step_s"] < colocated["step_time"]["step_s"]
    assert colocated["step_time"]["rollout_s"] > colocated["step_time"]["train_s"]  # decode-bound
    assert {"engine.placement=disaggregated", "engine.replica_devices=4,5,6,7", "engine.replica_nodes=0"} \
        <= set(split["overrides"])

    small = ["rollout.prompts_per_step=8"]
    cfg = load_config(None, [*JOB, *small])
    work = work_of(cfg, LLAMA_8B, 256, 512)
    found = ranked(count_params(LLAMA_8B), LLAMA_8B, cfg, 1, 8, 79.6, "bf16", False, PRESETS["h100"], work,
                   keep=100_000)
    splits = [st["step_s"] for lay, _, st in found["fitting"] if lay.engine_gpus]
    best = found["fitting"][0]
    assert splits and best[0].colocated and best[2]["step_s"] < min(splits)
    assert _plan(["rollout.overlap=async", *small], response=512)["step_time"]["step_s"] > best[2]["step_s"]


def test_doubling_the_nodes_never_raises_the_step_time_with_only_disaggregated_layouts():
    times = [_plan(["rollout.overlap=async"], nodes)["step_time"]["step_s"] for nodes in (1, 2, 4)]
    assert times[1] <= times[0] and times[2] <= times[1], times


def test_the_settings_line_says_how_many_trainer_processes_to_launch(tmp_path, capsys):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(LLAMA_8B))
    assert main(["--model", str(model), "--nodes", "1", *JOB, "rollout.overlap=async", "--prompt-tokens", "256",
                 "--response-tokens", "1024"]) == 0
    out = capsys.readouterr().out
    assert "engine.replica_devices=4,5,6,7   (launch with TRAINER_GPUS_PER_NODE=4: the trainer on GPUs 0..3 of " \
           "each node, sbatch --gpus-per-node 8)" in out, out
    assert "4 engine GPUs a node: trainer TP" in out and "on GPUs 4,5,6,7 of each node" in out
    # the trainer's processes given: only the splits that leave it those GPUs
    assert main(["--model", str(model), "--nodes", "2", "--trainer-gpus-per-node", "6", "--json", *JOB]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["layout"]["trainer_gpus_per_node"] == 6 and res["layout"]["replica_devices"] == "6,7"
    assert all(p["layout"]["engine_gpus"] == 2 for p in res["proposals"])
    assert "engine.replica_nodes=2" in res["overrides"]  # both nodes host their share


@pytest.mark.parametrize("given,message", [
    (["--trainer-gpus-per-node", "6", "engine.replica_devices=4,5"],
     "engine.replica_devices='4,5' takes GPU 4, which trainer local rank 4 holds (the trainer runs 6 processes a "
     "node, on GPUs 0..5: TRAINER_GPUS_PER_NODE / --nproc); valid ids: 6..7"),
    (["--trainer-gpus-per-node", "6", "engine.replica_devices=6,8"],
     "engine.replica_devices='6,8' names GPU 8, but a node has 8 GPUs (0..7)"),
    (["engine.replica_devices=6,6"], "engine.replica_devices='6,6': must be distinct CUDA device ids"),
    (["--trainer-gpus-per-node", "7", "engine.replica_devices=7"],
     "engine.replica_devices='7': disaggregated replicas on GPUs need (engine.replicas / hosting nodes) × "
     "engine.tensor_parallel_size = 2 CUDA device ids"),
    (["--trainer-gpus-per-node", "9"], "--trainer-gpus-per-node 9: valid 1..8"),
], ids=["overlap", "beyond", "twice", "count", "flag"])
def test_replica_devices_are_checked_against_the_trainers_gpus_and_the_nodes(tmp_path, capsys, given, message):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(LLAMA_8B))
    split = ["engine.placement=disaggregated", "engine.replicas=4", "engine.replica_nodes=2"]
    assert main(["--model", str(model), "--nodes", "2", *JOB, *split, *given]) == 2
    assert message in capsys.readouterr().err


def test_the_trainers_gpus_follow_from_replica_devices_when_not_given(tmp_path, capsys):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(LLAMA_8B))
    split = ["engine.placement=disaggregated", "engine.replicas=4", "engine.replica_nodes=2",
             "engine.replica_devices=6,7", "rollout.overlap=one_step"]
    assert main(["--model", str(model), "--nodes", "2", "--json", *JOB, *split]) in (0, 1)
    res = json.loads(capsys.readouterr().out)
    assert res["layout"]["trainer_gpus_per_node"] == 6 and res["layout"]["dp"] == 12
    assert res["step_time"]["train"]["gpus"] == 12 and res["step_time"]["rollout"]["replicas"] == 4
    dedicated = ["engine.placement=disaggregated", "engine.replicas=2", "engine.tensor_parallel_size=4",
                 "engine.replica_nodes=1", "engine.replica_nodes_dedicated=true",
                 "engine.replica_devices=0,1,2,3,4,5,6,7"]
    assert main(["--model", str(model), "--nodes", "2", "--json", *JOB, *dedicated]) in (0, 1)  # no trainer there
    assert json.loads(capsys.readouterr().out)["layout"]["trainer_gpus_per_node"] == 8


def test_an_example_plans_the_split_it_is_given_and_refuses_a_clash_before_submitting():
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "PLAN_ONLY": "1"}
    split = ["parallel.tp=2", "engine.placement=disaggregated", "engine.tensor_parallel_size=2", "engine.replicas=2",
             "engine.replica_devices=4,5,6,7", "rollout.overlap=one_step", "trainer.precision=bf16"]
    ok = subprocess.run(["bash", "examples/qwen2.5-32b.sh", *split], capture_output=True, text=True, cwd=ROOT,
                        env={**env, "TRAINER_GPUS_PER_NODE": "4"}, timeout=60)
    assert "on GPUs 4,5,6,7 of each node" in ok.stdout, ok.stdout + ok.stderr
    assert "(launch with TRAINER_GPUS_PER_NODE=4: the trainer on GPUs 0..3 of each node" in ok.stdout
    clash = subprocess.run(["bash", "examples/qwen2.5-32b.sh", *split], capture_output=True, text=True, cwd=ROOT,
                           env={**env, "TRAINER_GPUS_PER_NODE": "6"}, timeout=60)
    assert clash.returncode == 2 and "engine.replica_devices='4,5,6,7' takes GPU 4" in clash.stderr, clash.stderr
    assert "nothing submitted" in clash.stderr


def test_replica_device_ids_count_the_gpus_the_trainer_sees():
    """A replica's CUDA_VISIBLE_DEVICES: its ids through the trainer's own (Slurm's allocation '4,5,6,7' makes id 2
    GPU 6; set absolutely it would take GPU 2, which another job holds); unset, the ids as they are."""
    from megarl.engines.remote.process import replica_visible_devices

    assert replica_visible_devices("2,3", "4,5,6,7") == "6,7"
    assert replica_visible_devices("6,7", None) == "6,7" and replica_visible_devices("6,7", "") == "6,7"
    assert replica_visible_devices("1", "GPU-aa, GPU-bb") == "GPU-bb"  # UUIDs pass as they are
    with pytest.raises(ValueError, match=r"names GPU 4, but this node's trainer process sees 4 \(CUDA_VISIBLE"):
        replica_visible_devices("4", "4,5,6,7")
