"""``megarl plan``'s step-time model: each term against a hand calculation for a dense and an MoE model (the
published shapes), the ranking's preferences, more nodes never slower, the GPU presets and flags, bad flags.
Pure Python, fast."""

import json
import math
import re

import pytest

from helpers.plans import QWEN3_30B_A3B, QWEN25_32B
from megarl.config import ConfigError, load_config
from megarl.launch.gpus import PRESETS, gpu_of
from megarl.launch.layout import Layout
from megarl.launch.memory import GIB, memory_gib
from megarl.launch.model_size import count_params
from megarl.launch.plan import main, plan
from megarl.launch.ranking import ranked
from megarl.launch.step_time import Work, step_time, work_of

H100 = PRESETS["h100"]
HBM = 3.35e12 * 0.7  # the bandwidth a decode step's reads reach (HBM_EFFICIENCY)
NVLINK, NETWORK, HOST = 450e9, 50e9, 55e9
# 16 prompts × 8 samples of 100 + 400 tokens (cap 1000), one row of 2048 tokens per micro-batch, bf16.
RUN = ["rollout.prompts_per_step=16", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=1000",
       "engine.max_model_len=2048", "optim.micro_batch_size=1", "engine.slots=64", "engine.kv_cache_gib=8",
       "trainer.precision=bf16"]
WORK = Work(sequences=128, prompt_tokens=100, response_tokens=400, max_response=1000, mfu=0.4)
T, S = 128 * 500, 500  # trained tokens, their length


def _times(hf, lay, overrides=(), work=WORK, gpu=H100):
    cfg = load_config(None, [*RUN, *overrides])
    counts = count_params(hf)
    return step_time(counts, hf, cfg, lay, gpu, work, memory_gib(counts, hf, cfg, lay, "bf16"))


def test_training_terms_of_a_dense_model_match_the_hand_calculation():
    """Qwen2.5-32B on 2 nodes × 8: TP 4 · PP 2 · DP 2, distributed optimizer over the network."""
    lay = Layout(2, 8, tp=4, pp=2, sequence_parallel=True, engine_tp=4)
    t = _times(QWEN25_32B, lay)["train"]
    c = count_params(QWEN25_32B)
    n = c.total - c.embedding  # dense: every parameter is active; the input embedding is a lookup, not a GEMM
    h, layers, q = 5120, 64, 40 * 128
    flops = T * (6 * n + 6 * layers * q * S)
    assert t["flops"] == pytest.approx(flops)
    assert t["compute_s"] == pytest.approx(flops / (16 * 989e12 * 0.4))
    # 4 all-reduces per layer (2 forward, 2 backward) of (T/DP) × h bf16 values, ring 2(TP−1)/TP, L/PP layers
    assert t["tp_s"] == pytest.approx(T / 2 * layers / 2 * h * 2 * 4 * 2 * 3 / 4 / NVLINK)
    assert t["ep_s"] == 0.0
    micro = math.ceil(T / 2 / 2048)  # a DP rank's tokens in rows of engine.max_model_len
    assert t["microbatches"] == micro
    p2p = 2 * T / 2 * h * 2 / NVLINK  # activations between the 2 stages, in the node (TP·PP = 8)
    assert t["pp_s"] == pytest.approx(1 / micro * (t["compute_s"] + t["tp_s"]) + p2p)
    shared = (c.attention + c.dense) / 8 + max(c.embedding, c.head) / 4  # PP 2: a stage holds one of them
    assert t["dp_s"] == pytest.approx(shared * (4 + 2) * 1 / 2 / NETWORK)  # reduce-scatter fp32 + gather bf16
    assert t["optimizer_s"] == pytest.approx(shared / 2 * 32 / HBM)
    assert t["total_s"] == pytest.approx(sum(t[k] for k in ("compute_s", "tp_s", "pp_s", "dp_s", "optimizer_s")))
    ref = _times(QWEN25_32B, lay, ["algo.kl_coef=0.1"])["train"]  # a reference forward: 2 more FLOPs per 6
    assert ref["flops"] == pytest.approx(flops * 8 / 6) and ref["tp_s"] == pytest.approx(t["tp_s"] * 6 / 4)


def test_training_terms_of_an_moe_model_match_the_hand_calculation():
    """Qwen3-30B-A3B on 2 nodes × 8: TP 2 (sequence parallel), EP 16 over both nodes, DP 8."""
    lay = Layout(2, 8, tp=2, ep=16, etp=1, sequence_parallel=True, engine_tp=2)
    t = _times(QWEN3_30B_A3B, lay)["train"]
    c = count_params(QWEN3_30B_A3B)
    h, layers, q = 2048, 48, 32 * 128
    assert c.active == pytest.approx(3.35e9, rel=0.01)
    flops = T * (6 * (c.active - c.embedding) + 6 * layers * q * S)
    experts = T * 6 * c.experts_active  # the expert GEMMs' share, at their efficiency (2048 / 2 × 8 × 16 / 128
    assert t["tokens_per_expert"] == 1024 and 0.9 < t["expert_efficiency"] < 1  # = 1024 tokens an expert)
    assert t["flops"] == pytest.approx(flops)
    assert t["compute_s"] == pytest.approx((flops - experts + experts / t["expert_efficiency"]) / (16 * 989e12 * 0.4))
    # all-to-all of T/(DP·TP) tokens × top-8 × h, 4 times per MoE layer; of the 15 other ranks, 7 in the node
    moved = T / (8 * 2) * 48 * 8 * h * 2 * 4
    assert t["ep_s"] == pytest.approx(moved * (7 / 16 / NVLINK + 8 / 16 / NETWORK))
    assert t["pp_s"] == 0.0
    shared = (c.attention + c.dense) / 2 + (c.embedding + c.head) / 2
    experts = c.experts / 16  # expert DP = 16 / 16 = 1: nothing to reduce
    assert t["dp_s"] == pytest.approx(shared * 6 * 7 / 8 / NETWORK)
    assert t["optimizer_s"] == pytest.approx((shared / 8 + experts) * 32 / HBM)


def _kv_token(hf, engine_tp):
    return 2 * hf["num_hidden_layers"] * math.ceil(hf["num_key_value_heads"] / engine_tp) * 128 * 2


def test_rollout_terms_of_a_dense_model_match_the_hand_calculation():
    """Memory-bound decode: each step reads the engine's weights (less the embedding), the batch's KV cache and the
    sampler's fp32 passes over batch × vocabulary, all-reducing twice a layer and gathering the logits once."""
    lay = Layout(2, 8, tp=8, sequence_parallel=True, engine_tp=4)  # 4 replicas of TP 4
    r = _times(QWEN25_32B, lay)["rollout"]
    c = count_params(QWEN25_32B)
    assert r["replicas"] == 4 and r["batch"] == 32  # 128 sequences over 4 replicas, under the 64 slots
    weights = (c.total - c.embedding) * 2 / 4
    kv = 32 * (100 + 200) * _kv_token(QWEN25_32B, 4)  # mean context: the prompt and half the response
    sampler = 32 * 152064 * 70  # SAMPLER_BYTES an entry, on every TP rank
    assert r["sampler_bytes"] == pytest.approx(sampler)
    comm = 2 * 64 * (10e-6 + 32 * 5120 * 2 * 2 * 3 / 4 / NVLINK) + 10e-6 + 32 * 152064 * 2 * 3 / 4 / NVLINK
    step = (weights + kv + sampler) / HBM + comm
    assert r["decode_step_s"] == pytest.approx(step)
    steps = 32 * 400 / 32 + (1000 - 400)  # sync mode: the longest ends last (the cap)
    assert r["steps"] == pytest.approx(steps) and r["decode_s"] == pytest.approx(steps * step)
    n = c.total - c.embedding
    head = 152064 * 5120  # the output head multiplies each prompt's last position alone
    assert r["prefill_s"] == pytest.approx(32 * (100 * (2 * (n - head) + 2 * 64 * 5120 * 100) + 2 * head)
                                           / (4 * 989e12 * 0.4))
    # the simulator's engine step: base + per_seq × the batch is the step
    assert r["step_base_s"] + 32 * r["step_per_seq_s"] == pytest.approx(step)
    partial = _times(QWEN25_32B, lay, ["rollout.mode=partial"])["rollout"]  # measured bubble 8%, no waste
    assert partial["steps"] == pytest.approx(32 * 400 / 32 / 0.92)
    given = _times(QWEN25_32B, lay, work=Work(128, 100, 400, 1000, 0.4, bubble=0.5))["rollout"]
    assert given["steps"] == pytest.approx(32 * 400 / 32 / 0.5)


def test_decode_reads_the_output_head_tied_or_not_and_samples_over_the_vocabulary():
    """A decode step multiplies by the output head whether or not it is tied to the input embedding (the same
    bytes), and the sampler's passes grow with the vocabulary (as much as the weights of a small model)."""
    lay = Layout(2, 8, tp=8, sequence_parallel=True, engine_tp=4)
    untied = _times(QWEN25_32B, lay)["rollout"]
    tied = _times({**QWEN25_32B, "tie_word_embeddings": True}, lay)["rollout"]
    assert count_params({**QWEN25_32B, "tie_word_embeddings": True}).total < count_params(QWEN25_32B).total
    assert tied["weight_bytes"] == pytest.approx(untied["weight_bytes"])
    assert tied["decode_step_s"] == pytest.approx(untied["decode_step_s"])
    wider = _times({**QWEN25_32B, "vocab_size": 2 * 152064}, lay)["rollout"]
    assert wider["sampler_bytes"] == pytest.approx(2 * untied["sampler_bytes"])
    head = 152064 * 5120 * 2 / 4  # the wider head's extra rows a GPU reads, and the extra sampled and gathered logits
    extra = (head + untied["sampler_bytes"]) / HBM + 32 * 152064 * 2 * 3 / 4 / NVLINK
    assert wider["decode_step_s"] - untied["decode_step_s"] == pytest.approx(extra)


def test_moe_decode_reads_the_experts_its_batch_touches():
    lay = Layout(2, 8, tp=2, ep=16, etp=1, sequence_parallel=True, engine_tp=2)  # 8 replicas × batch 16
    r = _times(QWEN3_30B_A3B, lay)["rollout"]
    c = count_params(QWEN3_30B_A3B)
    assert r["batch"] == 16
    touched = 128 * (1 - (1 - 8 / 128) ** 16)  # distinct experts 16 tokens × top-8 of 128 reach, per layer: 82
    expert = 3 * 2048 * 768
    assert r["weight_bytes"] == pytest.approx((c.total - c.experts - c.embedding + 48 * touched * expert) * 2 / 2)
    assert r["weight_bytes"] < 0.7 * c.total * 2 / 2  # a third of the experts unread: small batches are cheaper


def test_sync_terms_and_how_the_step_combines_them():
    lay = Layout(1, 8, tp=8, sequence_parallel=True, engine_tp=8)
    c = count_params(QWEN25_32B)
    per_gpu = c.total * 2 / 8
    awake = _times(QWEN25_32B, lay)
    # NeMo-RL's measured refit rates, not the link's: colocated 3.2 GB/s an engine GPU, disaggregated 19.7 + 0.48 s
    assert awake["sync"]["transfer_s"] == pytest.approx(per_gpu / 3.2e9) and awake["sync"]["sleep_s"] == 0
    assert awake["step_s"] == pytest.approx(awake["train_s"] + awake["rollout_s"] + awake["sync_s"])
    asleep = _times(QWEN25_32B, Layout(1, 8, tp=8, sequence_parallel=True, engine_tp=8, sleep_level=1,
                                       offload=True))
    mem = memory_gib(c, QWEN25_32B, load_config(None, RUN), lay, "bf16")
    assert asleep["sync"]["sleep_s"] == pytest.approx(2 * per_gpu / HOST)  # weights to host and back
    assert asleep["sync"]["offload_s"] == pytest.approx(2 * (mem["gradients"] + mem["optimizer"]) * GIB / HOST)
    dropped = _times(QWEN25_32B, Layout(1, 8, tp=8, sequence_parallel=True, engine_tp=8, sleep_level=2))
    assert dropped["sync"]["sleep_s"] == 0  # level 2: the sync refills the weights it sends anyway
    apart = Layout(1, 8, tp=8, sequence_parallel=True, engine_tp=8, placement="disaggregated", engine_nodes=1)
    none = _times(QWEN25_32B, apart)
    assert none["sync"]["transfer_s"] == pytest.approx(0.48 + per_gpu / 19.7e9)  # into each engine GPU
    overlap = _times(QWEN25_32B, apart, ["rollout.overlap=one_step"])
    assert overlap["overlap"] and not none["overlap"]
    assert overlap["step_s"] == pytest.approx(max(none["train_s"], none["rollout_s"]) + none["sync_s"])
    assert none["step_s"] == pytest.approx(none["train_s"] + none["rollout_s"] + none["sync_s"])
    assert awake["bound"] == max(("training-bound", awake["train_s"]), ("rollout-bound", awake["rollout_s"]),
                                 key=lambda x: x[1])[0]


README_RUN = ["engine.max_model_len=4096", "optim.micro_batch_size=1", "engine.slots=64", "engine.kv_cache_gib=12",
              "rollout.prompts_per_step=32", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=3072"]


def test_small_tp_replicas_beat_one_cross_node_engine_and_the_proposal_takes_them():
    """Qwen3-30B-A3B decodes memory-bound: 4 replicas of TP 4 each hold 64 of the 256 sequences at once and pay
    NVLink all-reduces; one engine of TP 16 holds 64 (engine.slots) of them, so decodes 4 waves, and pays 2·L
    all-reduces over the network every token."""
    cfg = load_config(None, README_RUN)
    work = work_of(cfg, QWEN3_30B_A3B)
    trainer = dict(tp=2, ep=16, etp=1, sequence_parallel=True)
    cross = _times(QWEN3_30B_A3B, Layout(2, 8, engine_tp=16, **trainer), README_RUN, work)["rollout"]
    small = _times(QWEN3_30B_A3B, Layout(2, 8, engine_tp=4, **trainer), README_RUN, work)["rollout"]
    assert cross["across_nodes"] and not small["across_nodes"] and not cross["compute_bound"]
    assert small["total_s"] < cross["total_s"] / 1.15
    res = plan(QWEN3_30B_A3B, cfg, 2, 8, 80, propose=True)
    assert res["fits"] and res["layout"]["engine_tp"] <= 8 and res["layout"]["engine_replicas"] >= 2
    assert len(res["proposals"]) == 3
    times = [p["step_time"]["step_s"] for p in res["proposals"]]
    assert times == sorted(times) and all(p["memory_gib"] <= 80 for p in res["proposals"])
    assert res["step_time"]["step_s"] < _times(QWEN3_30B_A3B, Layout(2, 8, engine_tp=16, **trainer), README_RUN,
                                               work)["step_s"]


def test_an_engine_tp_that_fits_is_ranked_over_a_faster_one_that_does_not_at_every_sleep_level(monkeypatch):
    """With 8 slots an engine, engine TP 1 (16 replicas: 128 sequences at once) would decode fastest were its expert
    reads as fast as its other reads (set so here: at vLLM's measured fused-MoE rate they are not), but its 57 GiB of
    weights per GPU do not fit beside the trainer's state at any sleep level (without the trainer's offload, which
    makes room while generating); TP 4 fits at each."""
    import megarl.launch.rollout_time as rollout_time

    monkeypatch.setattr(rollout_time, "MOE_READ_EFFICIENCY", rollout_time.HBM_EFFICIENCY)
    run = [*README_RUN, "engine.slots=8"]
    cfg = load_config(None, run)
    counts, work = count_params(QWEN3_30B_A3B), work_of(cfg, QWEN3_30B_A3B)
    found = ranked(counts, QWEN3_30B_A3B, cfg, 2, 8, 80, "bf16", False, H100, work, keep=100_000)
    trainer = dict(tp=2, ep=16, etp=1, sequence_parallel=True)
    for level in (0, 1, 2):
        one = Layout(2, 8, engine_tp=1, sleep_level=level, **trainer)
        four = Layout(2, 8, engine_tp=4, sleep_level=level, **trainer)
        assert memory_gib(counts, QWEN3_30B_A3B, cfg, one, "bf16")["total"] > 80
        assert memory_gib(counts, QWEN3_30B_A3B, cfg, four, "bf16")["total"] <= 80
        assert _times(QWEN3_30B_A3B, one, run, work)["rollout_s"] < _times(QWEN3_30B_A3B, four, run, work)["rollout_s"]
        at_level = [lay for lay, _, _ in found["fitting"]
                    if lay.colocated and lay.sleep_level == level and not lay.offload]
        assert at_level and four in at_level and all(lay.engine_tp > 1 for lay in at_level)


@pytest.mark.parametrize("hf,run", [(QWEN3_30B_A3B, README_RUN),
                                    (QWEN25_32B, README_RUN)],
                         ids=["moe", "dense"])
def test_doubling_the_nodes_never_raises_the_proposals_step_time(hf, run):
    cfg = load_config(None, run)
    times = [plan(hf, cfg, nodes, 8, 80, propose=True)["step_time"]["step_s"] for nodes in (1, 2, 4)]
    assert times[1] <= times[0] and times[2] <= times[1], times


def test_presets_and_flags_set_the_figures(tmp_path, capsys):
    assert set(PRESETS) == {"a100", "h100", "h200", "b200"}
    assert PRESETS["h200"].hbm_tbps > PRESETS["h100"].hbm_tbps and PRESETS["b200"].peak_tflops > 2000
    slow = gpu_of("h100", hbm_tbps=3.35 / 2)
    lay = Layout(1, 8, tp=8, sequence_parallel=True, engine_tp=8)
    fast_r, slow_r = (_times(QWEN25_32B, lay, gpu=g)["rollout"] for g in (H100, slow))
    assert slow_r["decode_step_s"] - slow_r["comm_s"] == pytest.approx(2 * (fast_r["decode_step_s"] -
                                                                             fast_r["comm_s"]))
    model = tmp_path / "config.json"
    model.write_text(json.dumps(QWEN3_30B_A3B))
    job = ["--model", str(model), "--nodes", "2", "--json", *README_RUN]
    assert main([*job, "--gpu", "h200"]) in (0, 1)
    res = json.loads(capsys.readouterr().out)
    assert res["gpu"]["name"] == "h200" and res["gpu_mem_gib"] == PRESETS["h200"].mem_gib  # the preset's memory
    assert main([*job, "--gpu", "h200", "--gpu-mem-gib", "80", "--network-gbps", "25", "--mfu", "0.3",
                 "--prompt-tokens", "500", "--response-tokens", "2000"]) in (0, 1)
    res = json.loads(capsys.readouterr().out)
    st = res["step_time"]
    assert res["gpu_mem_gib"] == 80 and res["gpu"]["network_gbps"] == 25 and st["train"]["mfu"] == 0.3
    assert st["work"] == {"sequences": 256, "prompt_tokens": 500, "response_tokens": 2000, "max_response": 3072}
    assert main(["--model", str(model), "--nodes", "2", *README_RUN]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step time")]
    form = (r"step time +\d+\.\d s/step \(train \d+\.\d s, rollout \d+\.\d s, sync \d+\.\d s; "
            r"(training|rollout|sync)-bound\)")
    assert len(lines) == 3 and all(re.match(form, ln) for ln in lines), lines


@pytest.mark.parametrize("flags,message", [
    (["--gpu", "h300"], "--gpu h300: not a preset; valid: a100, h100, h200, b200"),
    (["--mfu", "0"], "--mfu must be in (0, 1], got 0"),
    (["--mfu", "40"], "--mfu must be in (0, 1], got 40 (a share of the peak: 0.4 is 40%)"),
    (["--bubble", "1"], "--bubble must be in [0, 1), got 1"),
    (["--hbm-tbps", "-3"], "--hbm-tbps must be > 0, got -3"),
    (["--gpu-mem-gib", "0"], "--gpu-mem-gib must be > 0, got 0"),
    (["--response-tokens", "5000"], "--response-tokens 5000: valid 1 .. rollout.max_new_tokens=3072"),
    (["--prompt-tokens", "4000"], "--prompt-tokens 4000: valid 1 .. 2560 (engine.max_model_len=4096 less the mean"),
], ids=["preset", "mfu0", "mfu40", "bubble", "hbm", "mem", "response", "prompt"])
def test_bad_flag_values_are_refused_naming_the_flag_and_what_is_valid(tmp_path, capsys, flags, message):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(QWEN3_30B_A3B))
    assert main(["--model", str(model), "--nodes", "2", *README_RUN, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_a_figure_no_preset_has_is_refused():
    with pytest.raises(ConfigError, match="unknown GPU figure 'tflops'"):
        gpu_of("h100", tflops=1.0)


def test_the_simulator_takes_a_named_layouts_costs_from_the_plan(tmp_path, capsys):
    """tools/simulate_rollout.py --plan: engines = the layout's replicas, slots = its batch, the planner's cost of a
    decode step; on equal lengths a sync phase lasts the planner's decode steps (no tail: nothing runs longer)."""
    import importlib.util

    from helpers.scripts import ROOT

    spec = importlib.util.spec_from_file_location("simulate_rollout", ROOT / "tools/simulate_rollout.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    model = tmp_path / "config.json"
    model.write_text(json.dumps(QWEN3_30B_A3B))
    assert main(["--model", str(model), "--nodes", "2", "--json", *README_RUN]) == 0
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(capsys.readouterr().out)
    res = json.loads(plan_file.read_text())
    second = res["proposals"][1]["step_time"]
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("1000\n" * 256)  # 32 groups of 8, all 1000 tokens
    assert tool.main(["--lengths", str(lengths), "--group-size", "8", "--prompts-per-step", "32", "--max-tokens",
                      "3072", "--mode", "sync", "--plan", str(plan_file), "--proposal", "2", "--overlap",
                      "none"]) == 0
    gen, timed = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    r = second["rollout"]
    waves = math.ceil(256 / (r["replicas"] * r["batch"]))
    assert gen["phase_s_max"] == pytest.approx(waves * 1000 * r["decode_step_s"], rel=0.02)
    # training at the plan's seconds per response token (its train_s over its 256 × 1536), one sync of the plan's
    per_token = second["train_s"] / (256 * second["work"]["response_tokens"])
    assert timed["wall_s"] == pytest.approx(gen["phase_s_max"] + per_token * 256 * 1000 + second["sync_s"], rel=0.02)
    for bad, message in ((["--proposal", "9"], "--proposal 9: "), (["--plan", str(lengths)], "not a megarl plan")):
        with pytest.raises(SystemExit, match=message):
            tool.main(["--lengths", str(lengths), "--group-size", "8", "--plan", str(plan_file), *bad])
