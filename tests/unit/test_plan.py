"""``megarl plan`` on the real shapes of four public models: parameter counts against the published
totals, memory per part against a hand calculation, refusals that name the key. Pure Python, fast."""

import json
import re
import subprocess
import sys

import pytest
import torch

from helpers.plans import QWEN3_30B_A3B, QWEN25_32B, RUN
from helpers.scripts import ROOT
from megarl.config import ConfigError, load_config
from megarl.launch.plan import GIB, check_layout, count_params, main, plan

# config.json values as published on the Hugging Face Hub (only the keys a plan reads, plus the type).
QWEN3_235B_A22B = {"model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
                   "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
                   "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                   "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
                   "max_position_embeddings": 40960, "tie_word_embeddings": False}
MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
                "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
                "tie_word_embeddings": False}
MODELS = {"qwen2.5-32b": QWEN25_32B, "qwen3-30b-a3b": QWEN3_30B_A3B, "qwen3-235b-a22b": QWEN3_235B_A22B,
          "mixtral-8x7b": MIXTRAL_8X7B}

# Published totals (model cards): Qwen2.5-32B "32.5B" (32.76 B counted exactly by others too);
# Qwen3-30B-A3B 30.5 B / 3.3 B active; Qwen3-235B-A22B 235 B / 22 B active; Mixtral 46.7 B / 12.9 B active.
PUBLISHED = {"qwen2.5-32b": (32.5e9, 32.5e9), "qwen3-30b-a3b": (30.5e9, 3.3e9),
             "qwen3-235b-a22b": (235e9, 22e9), "mixtral-8x7b": (46.7e9, 12.9e9)}



@pytest.mark.parametrize("name", MODELS)
def test_parameter_counts_match_the_published_totals(name):
    counts = count_params(MODELS[name])
    total, active = PUBLISHED[name]
    assert counts.total == pytest.approx(total, rel=0.02)
    assert counts.active == pytest.approx(active, rel=0.03)
    if name == "qwen2.5-32b":
        assert counts.active == counts.total


def test_tied_embeddings_and_dense_layers_and_shared_experts_are_counted():
    tied = count_params({**QWEN25_32B, "tie_word_embeddings": True})
    assert count_params(QWEN25_32B).total - tied.total == 152064 * 5120
    # Two dense layers instead of MoE: their experts go, a dense MLP (3·h·intermediate) comes.
    dense2 = count_params({**QWEN3_30B_A3B, "mlp_only_layers": [0, 47]})
    base = count_params(QWEN3_30B_A3B)
    assert base.experts - dense2.experts == 2 * 128 * 3 * 2048 * 768
    assert dense2.dense - base.dense == 2 * (3 * 2048 * 6144 - 2048 * 128)
    shared = count_params({**QWEN3_30B_A3B, "shared_expert_intermediate_size": 4096})
    assert shared.active - base.active == 48 * (3 * 2048 * 4096 + 2048)  # the shared expert and its gate


@pytest.mark.parametrize("name", ["llama_tied_llama3", "qwen3", "mistral", "qwen2_yarn", "qwen3_moe", "mixtral",
                                  "qwen2_moe"])
def test_parameter_counts_equal_transformers_own_models_exactly(name):
    """Every family's count equals the parameters of the model transformers builds from the same config
    (qkv biases of both Qwen2 families, Qwen3's q/k norms, shared experts, tied embeddings)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers.hf_models import SMALL, SPECS

    model_type, extra = SPECS[name]
    cfg = AutoConfig.for_model(model_type, **{**SMALL, **extra})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert count_params(cfg.to_dict()).total == sum(p.numel() for p in model.parameters())


def _plan(hf, nodes, gpn, mem, overrides, propose=False, rank=True):
    cfg = load_config(None, ["trainer.precision=fp32", *RUN, *overrides])  # (the hand calculations are fp32's)
    return plan(hf, cfg, nodes, gpn, mem, propose, rank=rank)


def test_memory_of_a_dense_layout_matches_the_hand_calculation():
    """Qwen2.5-32B, 1 node × 8, trainer TP 8, engine TP 8, fp32 (4 B weights, 4 B grads, 8 B Adam); the KV cache
    is engine.kv_cache_gib (examples/qwen2.5-32b.sh's 16), equal here to what the rollout needs."""
    res = _plan(QWEN25_32B, 1, 8, 141, ["parallel.tp=8", "parallel.sequence_parallel=true",
                                        "engine.tensor_parallel_size=8", "engine.kv_cache_gib=16"])
    per_rank = 32.5e9 / 8  # the published total split 8 ways
    tokens = 1 * 4096  # micro_batch_size × max_model_len
    # per layer and token: attention 2h + 2q + 2kv, MLP h + 3f (floats), 64 layers, split by TP 8
    act = (2 * 5120 + 2 * 5120 + 2 * 1024 + 5120 + 3 * 27648) * 4 * 64 * tokens / 8
    kv = 64 * 4096 * 2 * 64 * 1 * 128 * 4  # 64 sequences × 4096 tokens × (k, v) × layers × 1 KV head/rank × 128
    hand = {"weights": per_rank * 4, "gradients": per_rank * 4, "optimizer": per_rank * 8, "activations": act,
            "logits": 1024 * 152064 / 8 * 4 * 2, "engine_weights": 32.5e9 * 4 / 8, "kv_cache": kv}
    mem = res["memory_gib_per_gpu"]
    for part, value in hand.items():
        assert mem[part] == pytest.approx(value / GIB, rel=0.10), part
    assert mem["total"] == pytest.approx(sum(hand.values()) / GIB + 2.0, rel=0.10)  # + 2 GiB overhead
    assert res["kv_cache_needed"] == pytest.approx(kv / GIB) and res["kv_cache_sequences_held"] == 64
    assert res["fits"] and res["layout"]["dp"] == 1 and res["params_active"] == res["params_total"]
    assert not _plan(QWEN25_32B, 1, 8, 80, ["parallel.tp=8", "parallel.sequence_parallel=true",
                                             "engine.tensor_parallel_size=8", "engine.kv_cache_gib=16"])["fits"]


def test_precision_sizes_the_trainer_and_the_engine_and_the_plan_states_its_bytes_per_parameter(tmp_path, capsys):
    """trainer.precision=bf16: 2 B weights, fp32 gradients, 12 B of optimizer state (fp32 main weights + Adam);
    the engine in bf16 too unless engine.dtype says otherwise; the table says what it assumed."""
    job = ["parallel.tp=8", "parallel.sequence_parallel=true", "engine.tensor_parallel_size=8",
           "engine.kv_cache_gib=16"]
    fp32 = _plan(QWEN25_32B, 1, 8, 141, [*job, "trainer.precision=fp32"])
    bf16 = _plan(QWEN25_32B, 1, 8, 141, [*job, "trainer.precision=bf16"])
    mixed = _plan(QWEN25_32B, 1, 8, 141, [*job, "trainer.precision=bf16", "engine.dtype=float32"])
    m32, m16, mix = (r["memory_gib_per_gpu"] for r in (fp32, bf16, mixed))
    assert m16["weights"] == pytest.approx(m32["weights"] / 2) and m16["gradients"] == pytest.approx(m32["gradients"])
    assert m16["optimizer"] == pytest.approx(m32["optimizer"] * 12 / 8)
    assert m16["engine_weights"] == pytest.approx(m32["engine_weights"] / 2) == pytest.approx(mix["engine_weights"] / 2)
    assert res_bytes(bf16) == {"weights": 2, "gradients": 4, "optimizer": 12, "engine": 2}
    assert res_bytes(mixed)["engine"] == 4 and res_bytes(fp32) == {"weights": 4, "gradients": 4, "optimizer": 8,
                                                                    "engine": 4}
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_32B))
    main(["--model", str(tmp_path), "--nodes", "1", "--gpus-per-node", "8", "--precision", "bf16", *job])
    assert ("precision bf16 (bytes per parameter: weights 2, gradients 4, optimizer 12, engine 2)"
            in capsys.readouterr().out)


def res_bytes(res: dict) -> dict:
    return res["bytes_per_param"]


def test_memory_of_an_moe_layout_matches_the_hand_calculation():
    """Qwen3-30B-A3B, 2 nodes × 8: TP 2, EP 16 (expert TP 1), DP 8, distributed optimizer."""
    res = _plan(QWEN3_30B_A3B, 2, 8, 80, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=16",
                                          "parallel.etp=1", "engine.tensor_parallel_size=16"])
    experts = 48 * 128 * 3 * 2048 * 768  # 29.0 B routed expert weights
    rest = 30.5e9 - experts  # attention, embeddings, routers: split by TP 2
    per_rank = rest / 2 + experts / 16
    # distributed optimizer: dense part over DP 8; experts over expert-DP = 16 / (EP 16 · ETP 1) = 1
    optimizer = (rest / 2 / 8 + experts / 16 / 1) * 8
    mem = res["memory_gib_per_gpu"]
    assert mem["weights"] == pytest.approx(per_rank * 4 / GIB, rel=0.10)
    assert mem["optimizer"] == pytest.approx(optimizer / GIB, rel=0.10)
    assert res["optimizer_without_distributed"] == pytest.approx(per_rank * 8 / GIB, rel=0.10)
    assert mem["engine_weights"] == pytest.approx(30.5e9 * 4 / 16 / GIB, rel=0.10)
    assert res["layout"]["dp"] == 8 and res["fits"]


def test_without_layout_settings_the_fastest_fitting_layout_is_proposed():
    res = _plan(MIXTRAL_8X7B, 2, 8, 80, [], propose=True)
    lay = res["layout"]
    assert res["proposed"] and res["fits"]
    # The proposal is valid, fits and costs the same when given explicitly.
    again = _plan(MIXTRAL_8X7B, 2, 8, 80, res["overrides"])
    assert again["fits"] and again["layout"] == lay
    assert again["memory_gib_per_gpu"]["total"] == pytest.approx(res["memory_gib_per_gpu"]["total"])
    assert again["step_time"]["step_s"] == pytest.approx(res["step_time"]["step_s"])
    # No faster than the first fitting layout in the order of preference (smallest TP·PP: the old proposal).
    first = _plan(MIXTRAL_8X7B, 2, 8, 80, [], propose=True, rank=False)
    assert first["fits"] and res["step_time"]["step_s"] <= first["step_time"]["step_s"]


BAD = [  # model, nodes, GPUs per node, overrides, what the message must name
    ("qwen2.5-32b", 1, 8, ["parallel.tp=3"], "parallel.tp"),
    ("qwen3-30b-a3b", 1, 8, ["parallel.tp=8", "parallel.sequence_parallel=true"], "KV heads (4)"),
    ("mixtral-8x7b", 2, 8, ["parallel.ep=16"], "parallel.ep=16 must divide the number of experts (8)"),
    ("qwen3-235b-a22b", 1, 8, ["parallel.pp=4"], "parallel.pp=4 must divide the number of layers (94)"),
    ("qwen2.5-32b", 1, 8, ["parallel.pp=2", "parallel.vpp=3"], "parallel.vpp=3"),
    ("qwen2.5-32b", 1, 6, ["parallel.tp=4"], "must divide the world size 6"),
    ("qwen2.5-32b", 2, 6, ["parallel.tp=4"], "parallel.tp=4 must divide the GPUs per node (6)"),
    ("qwen2.5-32b", 2, 8, ["engine.tensor_parallel_size=16"], "engine.tensor_parallel_size=16"),
]


@pytest.mark.parametrize("name,nodes,gpn,overrides,message", BAD, ids=[b[-1][:24] for b in BAD])
def test_impossible_layouts_exit_2_naming_the_key(tmp_path, capsys, name, nodes, gpn, overrides, message):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(MODELS[name]))
    rc = main(["--model", str(model), "--nodes", str(nodes), "--gpus-per-node", str(gpn), *overrides])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert "valid" in err or "must" in err


def test_the_cli_prints_json_and_exits_1_when_it_does_not_fit(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_32B))
    cmd = [sys.executable, "-m", "megarl.cli", "plan", "--model", str(model), "--nodes", "1", "--gpus-per-node", "8",
           "--json", "parallel.tp=8", "parallel.sequence_parallel=true", "engine.tensor_parallel_size=8", *RUN]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 1, proc.stderr
    res = json.loads(proc.stdout)
    assert set(res) >= {"params_total", "params_active", "layout", "memory_gib_per_gpu", "fits"}
    assert res["fits"] is False and res["memory_gib_per_gpu"]["total"] > 80
    table = subprocess.run(cmd[:-len(RUN) - 4] + ["--gpu-mem-gib", "141"] + cmd[-len(RUN) - 3:],
                           capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert table.returncode == 0 and "vLLM KV cache" in table.stdout and "→ fits" in table.stdout


def test_train_runs_the_plans_checks_before_launching(tmp_path):
    """Engine TP 3 over 3 processes is a valid world but does not divide the tiny model's 4 heads."""
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", "configs/tiny_cpu.yaml", "--nproc", "3",
           "engine.tensor_parallel_size=3", f"model.path={tmp_path / 'model'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "engine.tensor_parallel_size=3 must divide the attention heads (4)" in proc.stderr
    assert not (tmp_path / "model").exists()  # nothing was launched


def test_check_layout_accepts_the_examples_layouts():
    for name, nodes, ov in [("qwen3-30b-a3b", 2, ["parallel.tp=2", "parallel.sequence_parallel=true",
                                                  "parallel.ep=16", "parallel.etp=1",
                                                  "engine.tensor_parallel_size=16"])]:
        check_layout(load_config(None, [*RUN, *ov]), MODELS[name], nodes, 8)
    with pytest.raises(ConfigError, match="--nodes"):
        check_layout(load_config(None, RUN), QWEN25_32B, 0, 8)


@pytest.mark.parametrize("script", ["qwen2.5-32b.sh", "qwen3-32b.sh", "qwen3-30b-a3b.sh", "qwen3-235b-a22b.sh"])
def test_each_example_validates_its_layout_with_plan(script):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "PLAN_ONLY": "1"}
    proc = subprocess.run(["bash", f"examples/{script}"], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "→ fits" in proc.stdout
    # sized with its recipe's own shapes (configs/*-dapo.yaml: 2,048 + 20,480 tokens, 32 prompts × 16 samples)
    assert "sized at  engine.max_model_len=22528 optim.micro_batch_size=1" in proc.stdout
    assert "rollout.prompts_per_step=32 rollout.samples_per_prompt=16" in proc.stdout
    assert ("· EP " in proc.stdout) == ("-a" in script)  # expert parallelism shown for the MoE models only
    assert re.search(r"^step time +\d+\.\d s/step \(train .*-bound\)$", proc.stdout, re.M), proc.stdout
    bad = subprocess.run(["bash", f"examples/{script}", "parallel.tp=3"], capture_output=True, text=True, cwd=ROOT,
                         env={**env, "PLAN_ONLY": "0"}, timeout=60)
    assert bad.returncode == 2 and "parallel.tp" in bad.stderr and "nothing submitted" in bad.stderr
    # a MODEL_PATH with no config.json here: planned with the example's shape (said), a submit refused
    assert "config.json is not on this machine: planning with the shape in" in proc.stderr
    unsent = subprocess.run(["bash", f"examples/{script}"], capture_output=True, text=True, cwd=ROOT,
                            env={**env, "PLAN_ONLY": "0", "MODEL_PATH": "/nonexistent/model"}, timeout=60)
    assert unsent.returncode == 2 and "MODEL_PATH=/nonexistent/model holds no config.json on this machine: " \
                                      "nothing submitted" in unsent.stderr, unsent.stderr


def test_expert_layout_errors_spell_out_etps_default_the_experts_and_valid_values(tmp_path, capsys):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(QWEN3_30B_A3B))
    job = ["--model", str(model), "--nodes", "2", "--gpus-per-node", "8"]
    assert main([*job, "parallel.tp=2", "parallel.ep=16", "parallel.sequence_parallel=true"]) == 2
    err = capsys.readouterr().err
    assert "parallel.ep=16 × parallel.etp=2 (parallel.etp=0 → parallel.tp=2) = 32 must divide tp×dp = 16" in err, err
    assert "the 128 experts): [1, 2, 4, 8] (or set parallel.etp=1: valid ep [1, 2, 4, 8, 16])" in err, err
    assert main([*job, "parallel.ep=5"]) == 2
    err = capsys.readouterr().err
    assert "parallel.ep=5 × parallel.etp=1 = 5" in err and "the 128 experts): [1, 2, 4, 8, 16]" in err, err
    assert "parallel.etp=0" not in err and "or set parallel.etp=1" not in err
    assert main([*job, "parallel.tp=2", "parallel.ep=16", "parallel.etp=1", "parallel.sequence_parallel=true"]) != 2
    assert "settings  parallel.tp=2" in capsys.readouterr().out  # the layout is planned (fitting or not)


def test_replica_nodes_beyond_the_jobs_nodes_are_refused_by_plan_and_the_batch_scripts_check(tmp_path, capsys):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(QWEN3_30B_A3B))
    disagg = ["engine.placement=disaggregated", "engine.replicas=4"]
    assert main(["--model", str(model), "--nodes", "2", *disagg, "engine.replica_nodes=4"]) == 2
    err = capsys.readouterr().err
    assert "engine.replica_nodes=4: the job has 2 node(s) (16 trainer processes); valid: [0, 1, 2]" in err, err
    launch = [sys.executable, "-m", "megarl.launch", "engine-nodes", *disagg]
    bad = subprocess.run([*launch, "--nodes", "2", "engine.replica_nodes=4"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("megarl: config error: engine.replica_nodes=4: the job has "
                                                         "2 node(s); valid: [0, 1, 2]"), bad.stderr
    assert len(bad.stderr.splitlines()) == 1 and not bad.stdout
    ok = subprocess.run([*launch, "--nodes", "3", "engine.replica_nodes=2", "engine.replica_nodes_dedicated=true"],
                        capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert ok.returncode == 0 and ok.stdout.strip() == "2", ok.stderr
    none_left = subprocess.run([*launch, "--nodes", "2", "engine.replica_nodes=2",
                                "engine.replica_nodes_dedicated=true"], capture_output=True, text=True, cwd=ROOT,
                               timeout=60)
    assert none_left.returncode == 2 and "valid: --nodes >= 3" in none_left.stderr


def test_train_refuses_replica_nodes_beyond_its_one_node_before_launching(tmp_path, capsys, monkeypatch):
    import megarl.cli

    def launched(args):
        raise AssertionError("torchrun was launched")  # would exec torchrun in place of this test process

    monkeypatch.setattr(megarl.cli, "_launch_torchrun", launched)
    cli_main = megarl.cli.main
    rc = cli_main(["train", "--config", "configs/tiny_cpu.yaml", "--nproc", "2", "engine.placement=disaggregated",
                   "engine.replicas=2", "engine.replica_nodes=2", f"model.path={tmp_path / 'model'}",
                   f"train.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.strip() == ("megarl: config error: engine.replica_nodes=2: the job has 1 node(s) (2 trainer "
                           "processes); valid: [0, 1] (0: rank 0's node; N: the job's last N nodes, dividing "
                           "engine.replicas=2), or ask for more nodes")
    assert not (tmp_path / "model").exists() and not (tmp_path / "run").exists()  # nothing was launched


def test_an_example_run_with_a_python_that_cannot_import_megarl_says_so(tmp_path):
    """Python's exit 1 for an import error is not megarl plan's "does not fit": the script names PYTHON."""
    bare = tmp_path / "bare-python"  # the real interpreter without site-packages or the repository on its path
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    bare.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(bare), "PLAN_ONLY": "1"}
    proc = subprocess.run(["bash", "examples/qwen3-30b-a3b.sh"], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=60)
    assert proc.returncode == 1 and "megarl plan refused this config" not in proc.stderr, proc.stderr
    assert f"could not run megarl plan with PYTHON={bare}" in proc.stderr and "set PYTHON=" in proc.stderr
    defaulted = subprocess.run(["bash", "-c", "source examples/common.sh; echo \"$PYTHON\""], capture_output=True,
                               text=True, cwd=ROOT, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    venv = ROOT / ".venv" / "bin" / "python"
    assert defaulted.stdout.strip() == (str(venv) if venv.exists() else "python3")


def test_plan_names_its_sizes_and_says_plainly_when_no_layout_fits(tmp_path, capsys):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(QWEN25_32B))
    # (micro-batches of 2 × 4096 tokens: without recompute no sleep level or offload makes one node's training phase
    # fit; full recompute does)
    run = ["optim.micro_batch_size=2", "engine.max_model_len=4096", "engine.slots=64", "optim.logprob_chunk=1024",
           "trainer.precision=fp32", "trainer.recompute=none", "--gpu-mem-gib", "80"]
    assert main(["--model", str(model), "--nodes", "1", "--gpus-per-node", "8", *run]) == 1
    out = capsys.readouterr().out
    assert ("sized at  engine.max_model_len=4096 optim.micro_batch_size=2 engine.slots=64" in out
            and "defaults" not in out)
    assert ("no layout of 1 node × 8 GPUs fits in 80 GiB per GPU at these sizes; the one shown is the closest. "
            "Would fit: trainer.recompute=full (activations ") in out, out
    assert "; about a third more training compute), --nodes 2 (× 8 GPUs); or a shorter engine.max_model_len" in out
    assert main(["--model", str(model), "--nodes", "2", "--gpus-per-node", "8", *run]) == 0  # as it said
    assert "no layout" not in capsys.readouterr().out
    # (at 141 GiB a trainer of TP 4 beside 2 engine GPUs a node fits on 8 nodes: 120 GiB, nothing up to 16; full
    # recompute would fit on 2)
    tiny = ["engine.max_model_len=256", "optim.micro_batch_size=64", "rollout.max_new_tokens=96"]  # the schema's
    assert main(["--model", str(model), "--nodes", "1", "--gpus-per-node", "6", "--gpu-mem-gib", "120",
                 "trainer.precision=fp32", "trainer.recompute=none", *tiny]) == 1
    out = capsys.readouterr().out
    assert "engine.max_model_len=256 optim.micro_batch_size=64" in out and "long-reasoning" not in out
    assert "None fits with trainer.precision=bf16 or up to --nodes 16 either" in out, out
    assert main(["--model", str(model), "--nodes", "4", "--gpus-per-node", "8", "--gpu-mem-gib", "120"]) in (0, 1)
    out = capsys.readouterr().out  # without --config or a sizing key: a long-reasoning step's sizes, said so
    assert "engine.max_model_len=17408 optim.micro_batch_size=1" in out and "a long-reasoning step" in out, out
    assert "512 sequences of 512 + 8192 tokens" in out, out


def test_plan_help_shows_a_command_that_works(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit):
        main(["--help"])
    usage = next(line for line in capsys.readouterr().out.splitlines()
                 if line.strip().startswith("megarl plan --model"))
    args = usage.split("megarl plan ", 1)[1].replace("[--gpu-mem-gib 80]", "").split()
    assert main(args) in (0, 1)  # planned (fits or not), not refused; run from the repository root
    assert "megarl plan:" not in capsys.readouterr().err
    assert main(["--model", "Qwen/Qwen2.5-32B"]) == 2
    assert "nothing is downloaded" in capsys.readouterr().err


LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
         "hidden_act": "silu", "tie_word_embeddings": False}


@pytest.mark.parametrize("change", [{"hidden_act": "gelu"}, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
                                    {"attention_bias": True}], ids=["gelu", "rope_dynamic", "attention_bias"])
def test_plan_refuses_what_train_refuses_with_trains_message(tmp_path, capsys, change):
    """A plan that says "fits" (exit 0) must be a job `megarl train` starts: the model-math refusals too."""
    from megarl.models.hf_config import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **change}))
    with pytest.raises(ValueError) as train_refusal:  # what `megarl train` says (its config check reads this way)
        read_hf_config(tmp_path)
    assert main(["--model", str(tmp_path), "--nodes", "1", "--gpus-per-node", "2"]) == 2
    assert capsys.readouterr().err.strip() == f"megarl plan: {train_refusal.value}"
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert main(["--model", str(tmp_path), "--nodes", "1", "--gpus-per-node", "2"]) == 0


def test_the_kv_line_is_engine_kv_cache_gib_and_says_when_it_holds_fewer_sequences(tmp_path, capsys):
    """The engines reserve exactly engine.kv_cache_gib per GPU (replicas' kv_cache_memory_bytes; the colocated
    engine's on a GPU, kv_cache_args): the plan's KV line and verdict are that, not what the rollout needs."""
    from megarl.engines.vllm_engine import kv_cache_args

    layout = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=16", "parallel.etp=1",
              "engine.tensor_parallel_size=16"]
    need = 64 * 4096 * 2 * 48 * 1 * 128 * 4 / GIB  # 64 sequences × 4096 tokens × (k, v) × 48 layers × 1 KV head/rank
    sized = _plan(QWEN3_30B_A3B, 2, 8, 80, [*layout, "engine.kv_cache_gib=12"])
    big = _plan(QWEN3_30B_A3B, 2, 8, 80, [*layout, "engine.kv_cache_gib=60"])
    small = _plan(QWEN3_30B_A3B, 2, 8, 80, [*layout, "engine.kv_cache_gib=8"])
    assert sized["kv_cache_needed"] == big["kv_cache_needed"] == pytest.approx(need) == 12.0
    assert big["memory_gib_per_gpu"]["kv_cache"] == 60.0 and not big["fits"]
    assert big["memory_gib_per_gpu"]["total"] == pytest.approx(sized["memory_gib_per_gpu"]["total"] + 48)
    assert small["memory_gib_per_gpu"]["kv_cache"] == 8.0 and small["fits"]
    assert small["kv_cache_sequences_held"] == 42 and sized["kv_cache_sequences_held"] == 64  # ⌊8 / (12/64)⌋
    cfg = load_config(None, [*RUN, *layout, "engine.kv_cache_gib=8"])
    reserved = kv_cache_args(cfg.engine.kv_cache_gib, gpu=True, gpu_total_bytes=80 * GIB)["kv_cache_memory_bytes"]
    assert reserved == 8 * GIB  # what is reserved
    assert kv_cache_args(cfg.engine.kv_cache_gib, gpu=False) == {}  # CPU: VLLM_CPU_KVCACHE_SPACE sizes it
    model = tmp_path / "config.json"
    model.write_text(json.dumps(QWEN3_30B_A3B))
    job = ["--model", str(model), "--nodes", "2", "--gpus-per-node", "8", *RUN, *layout, "trainer.precision=fp32"]
    assert main([*job, "engine.kv_cache_gib=8"]) == 0
    out = capsys.readouterr().out
    assert ("vLLM KV cache              8.00   engine.kv_cache_gib; 64 sequences at engine.max_model_len need "
            "12.00 GiB: it holds 42 at once at that length (vLLM admits up to engine.slots") in out, out
    assert main([*job, "engine.kv_cache_gib=60"]) == 1
    assert main([*job, "engine.kv_cache_gib=0.1"]) == 2  # not one 4096-token sequence: vLLM would not start
    assert "engine.kv_cache_gib=0.1 cannot hold one sequence of engine.max_model_len=4096" in capsys.readouterr().err


def test_the_plan_states_what_moe_routes_add_per_token_and_per_step():
    from megarl.launch.plan import route_bytes

    cfg = load_config(None, ["rollout.prompts_per_step=64", "rollout.samples_per_prompt=16",
                             "engine.max_model_len=8192"])
    r = route_bytes(QWEN3_235B_A22B, cfg)
    assert r["bytes_per_token"] == 94 * 8  # 94 MoE layers × top-8, one byte an id (128 experts)
    assert r["gib_per_step"] == pytest.approx(752 * 64 * 16 * 8192 / GIB)
    assert route_bytes(MIXTRAL_8X7B, cfg)["bytes_per_token"] == 32 * 2
    assert route_bytes(QWEN25_32B, cfg) == {}


def test_the_plan_states_the_route_bytes_each_trainer_rank_holds(capsys, tmp_path):
    """A rank holds its share of the trainer's batch (DP rows, stage's layers; the SP chunk unpacked), as much again
    for a pass; rank 0 also the samples' routes whole (it sends each rank its share)."""
    layout = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2", "parallel.ep=8",
              "parallel.etp=1", "engine.tensor_parallel_size=16", "engine.kv_cache_gib=8"]
    model = tmp_path / "config.json"
    model.write_text(json.dumps(QWEN3_30B_A3B))
    assert main(["--model", str(model), "--nodes", "2", "--gpus-per-node", "8", *RUN, *layout]) in (0, 1)
    out = capsys.readouterr().out
    r = _plan(QWEN3_30B_A3B, 2, 8, 80, [*RUN, *layout])["routes"]
    assert r["gib_per_rank_held"] == r["gib_per_rank_pass"] == pytest.approx(r["gib_per_step"] / (4 * 2))  # DP × PP
    assert r["gib_per_rank"] == pytest.approx(r["gib_per_step"] * 2 / 8)
    assert r["gib_rank_0"] == pytest.approx(r["gib_per_step"] * (1 + 2 / 8))  # + the samples' routes, whole
    assert (f"{r['gib_per_rank']:.3g} GiB on each trainer rank: its own rows, layers and sequence chunk "
            f"{r['gib_per_rank_held']:.3g} GiB") in out, out
    unpacked = _plan(QWEN3_30B_A3B, 2, 8, 80, [*RUN, *layout, "trainer.packing=false"])["routes"]
    assert unpacked["gib_per_rank_held"] == pytest.approx(r["gib_per_step"] / (4 * 2 * 2))  # and its SP chunk


def test_a_token_budget_sizes_the_activations_by_tokens_per_micro_batch(capsys, tmp_path):
    """Packed micro-batches of at most trainer.max_tokens_per_microbatch tokens: the activations scale with that
    budget instead of micro_batch_size × max_model_len, and the plan says what it sized at."""
    job = ["parallel.tp=8", "parallel.sequence_parallel=true", "engine.tensor_parallel_size=8",
           "engine.kv_cache_gib=16", "optim.micro_batch_size=4"]
    rows = _plan(QWEN25_32B, 1, 8, 141, job)["memory_gib_per_gpu"]["activations"]
    budget = _plan(QWEN25_32B, 1, 8, 141, [*job, "trainer.max_tokens_per_microbatch=8192"])
    assert budget["memory_gib_per_gpu"]["activations"] == pytest.approx(rows * 8192 / (4 * 4096))
    assert budget["sized_at"]["trainer.max_tokens_per_microbatch"] == 8192
    assert "trainer.max_tokens_per_microbatch" not in _plan(QWEN25_32B, 1, 8, 141, job)["sized_at"]
    model = tmp_path / "config.json"
    model.write_text(json.dumps(QWEN25_32B))
    assert main(["--model", str(model), "--nodes", "1", "--gpus-per-node", "8", *job,
                 "trainer.max_tokens_per_microbatch=8192"]) in (0, 1)
    assert "trainer.max_tokens_per_microbatch=8192" in capsys.readouterr().out


def test_the_plan_counts_cuda_graphs_and_a_gpu_memory_utilization_share():
    """CUDA graphs (engine.enforce_eager auto on GPUs) have a line of their own: the largest captured decode batch
    (min(2 · slots, 512) tokens) of activations and fp32 logits; with engine.gpu_memory_utilization the engine
    holds that share of the GPU in all, its KV cache what is left after its weights and graphs."""
    layout = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=16", "parallel.etp=1",
              "engine.tensor_parallel_size=16", "engine.kv_cache_gib=12", "engine.slots=256"]
    graphs = _plan(QWEN3_30B_A3B, 2, 8, 80, layout)["memory_gib_per_gpu"]
    eager = _plan(QWEN3_30B_A3B, 2, 8, 80, [*layout, "engine.enforce_eager=true"])["memory_gib_per_gpu"]
    per_token = (2 * 2048 + 2 * 4096 + 2 * 512 + 8 * 2 * 768) * 4 + 151936 * 4  # fp32 engine: activations, logits
    assert graphs["cuda_graphs"] == pytest.approx(512 * per_token / 16 / GIB) and eager["cuda_graphs"] == 0.0
    assert graphs["total"] == pytest.approx(eager["total"] + graphs["cuda_graphs"])
    share = _plan(QWEN3_30B_A3B, 2, 8, 80, [*layout, "engine.gpu_memory_utilization=0.5"])["memory_gib_per_gpu"]
    assert share["engine_weights"] + share["cuda_graphs"] + share["kv_cache"] == pytest.approx(40.0)
    assert share["total"] == pytest.approx(graphs["total"] - 12.0 - graphs["engine_weights"] - graphs["cuda_graphs"]
                                           + 40.0)


def test_a_gpu_memory_utilization_share_sizes_the_kv_cache_the_plan_counts_sequences_in(capsys, tmp_path):
    """With engine.gpu_memory_utilization the sequences the KV cache holds at once come from what that share leaves
    (not engine.kv_cache_gib), and the printed KV line names the share."""
    layout = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=16", "parallel.etp=1",
              "engine.tensor_parallel_size=16", "engine.slots=256", "engine.kv_cache_gib=0.5"]
    small = _plan(QWEN3_30B_A3B, 2, 8, 80, layout)
    share = _plan(QWEN3_30B_A3B, 2, 8, 80, [*layout, "engine.gpu_memory_utilization=0.5"])
    per_sequence = share["kv_cache_needed"] / share["kv_cache_sequences"]
    assert small["kv_cache_sequences_held"] == int(0.5 / per_sequence)
    held = min(share["kv_cache_sequences"], int(share["memory_gib_per_gpu"]["kv_cache"] / per_sequence))
    assert share["kv_cache_sequences_held"] == held > small["kv_cache_sequences_held"]
    model = tmp_path / "config.json"
    model.write_text(json.dumps(QWEN3_30B_A3B))
    main(["--model", str(model), "--nodes", "2", "--gpus-per-node", "8", "--gpu-mem-gib", "80", *layout,
          "engine.gpu_memory_utilization=0.5"])
    out = capsys.readouterr().out
    assert "engine.gpu_memory_utilization's rest;" in out and "engine.gpu_memory_utilization=0.5" in out
