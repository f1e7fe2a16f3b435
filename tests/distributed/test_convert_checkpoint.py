"""tools/convert_checkpoint.py: HF → megatron → (trainer at a layout) → megatron → HF, bit for bit.

Models come from transformers' own ``from_config`` + ``save_pretrained`` (``tests/helpers/hf_models.py``).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.conversion import TOOL, convert, fails, safetensors_bytes, tool
from helpers.hf_models import make_hf_model
from helpers.scripts import ROOT, run_script


def hf_logprobs(path, vocab):
    from transformers import AutoModelForCausalLM

    from helpers.trainers import fixed_batch

    batch = fixed_batch(vocab, seq=40)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch.input_ids).logits
    return torch.log_softmax(logits.float(), -1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1), batch.loss_mask


LAYOUTS = {"single": (), "tp2": ("--tp", 2), "pp2": ("--pp", 2), "ep2_alltoall": ("--ep", 2),
           "tp2_sp": ("--tp", 2), "pp2_vpp2": ("--pp", 2, "--vpp", 2), "tp2_pp2": ("--tp", 2, "--pp", 2),
           "tp2_sp_pp2": ("--tp", 2, "--pp", 2)}
LAYOUT_DIMS = {"single": (1, 1, 1, 1), "tp2": (2, 1, 1, 1), "pp2": (1, 2, 1, 1), "ep2_alltoall": (1, 1, 1, 2),
               "tp2_sp": (2, 1, 1, 1), "pp2_vpp2": (1, 2, 2, 1), "tp2_pp2": (2, 2, 1, 1), "tp2_sp_pp2": (2, 2, 1, 1)}
DEFAULT = [("qwen3_moe", "ep2_alltoall")]
SLOW = [("llama_tied_llama3", "pp2")]
SLOW += [(f, lay) for f in ("llama_tied_llama3", "mistral") for lay in ("single", "tp2", "tp2_pp2", "pp2_vpp2")]
SLOW += [("mistral", "pp2")]
SLOW += [(f, lay) for f in ("qwen3_moe", "mixtral", "qwen2_moe")
         for lay in ("single", "tp2_sp", "pp2", "tp2_sp_pp2", "pp2_vpp2", "ep2_alltoall")]
SLOW.remove(("qwen3_moe", "ep2_alltoall"))
SLOW += [("qwen2_yarn", "tp2")]  # YaRN RoPE: its tables are built while the converter's model is on meta
# dense layers beside MoE ones (keys only some layers have: stored over those layers, checkpoint/layer_axis.py)
SLOW += [("qwen2_moe_dense1", "single"), ("qwen2_moe_dense1", "pp2"), ("qwen2_moe_step2", "ep2_alltoall")]


def round_trip(tmp_path, family, layout):
    model = make_hf_model(tmp_path / "model", family, seed=1)
    other = make_hf_model(tmp_path / "other", family, seed=2)
    convert("hf-to-mcore", "--hf", model, "--out", tmp_path / "ckpt", *LAYOUTS[layout])
    assert not (tmp_path / "ckpt.tmp").exists()
    nproc = 4 if "tp2" in layout and "pp2" in layout else 2
    launcher = ([] if layout == "single"
                else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"])
    run_script([*launcher, "tests/workers/conversion_checks.py", layout, str(other), str(tmp_path / "ckpt"),
                str(tmp_path)], env={"OMP_NUM_THREADS": "1"})
    saved = json.loads((tmp_path / "ckpt" / "megarl_layout.json").read_text())  # the trainer re-saved it here
    assert (saved["tp"], saved["pp"], saved["vpp"], saved["ep"]) == LAYOUT_DIMS[layout], saved
    convert("mcore-to-hf", "--ckpt", tmp_path / "ckpt", "--hf-config", model, "--out", tmp_path / "back")
    original, back = safetensors_bytes(model), safetensors_bytes(tmp_path / "back")
    assert back.keys() == original.keys()
    for name in original:
        assert back[name] == original[name], name
    theirs, mask = hf_logprobs(model, json.loads((model / "config.json").read_text())["vocab_size"])
    ours = torch.load(tmp_path / "logprobs.pt")
    assert ((ours - theirs).abs() * mask).max() <= 1e-4
    return back


@pytest.mark.parametrize("family,layout", DEFAULT)
def test_round_trip_through_the_trainer_is_bit_identical(tmp_path, family, layout):
    back = round_trip(tmp_path, family, layout)
    if family.endswith("tied_llama3"):
        assert "lm_head.weight" not in back  # tied: one tensor, saved once


@pytest.mark.slow
@pytest.mark.parametrize("family,layout", SLOW)
def test_round_trip_at_every_layout(tmp_path, family, layout):
    round_trip(tmp_path, family, layout)


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    model = make_hf_model(tmp_path / "model", "qwen3_moe", seed=1)
    out = convert("hf-to-mcore", "--hf", model, "--out", tmp_path / "ckpt", "--ep", 2, "--dtype", "bf16", "--dry-run")
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight  (96, 128)  torch.bfloat16" in out.stdout
    assert "plan: " in out.stdout and "bytes" in out.stdout
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ckpt.tmp").exists()


def write_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


def test_errors_name_the_problem_before_any_output(tmp_path, capsys):
    model = make_hf_model(tmp_path / "model", "llama_tied_llama3", seed=1)
    to_mcore = ["hf-to-mcore", "--hf", model, "--out", tmp_path / "out"]
    fails(tmp_path, capsys, [*to_mcore, "--tp", 3], "--tp 3 must divide", "valid: [1, 2]")
    fails(tmp_path, capsys, [*to_mcore, "--pp", 3], "--pp 3", "valid: [1, 2, 4]")
    fails(tmp_path, capsys, [*to_mcore, "--ep", 2], "--ep 2 needs an MoE model")
    fails(tmp_path, capsys, ["mcore-to-hf", "--ckpt", model, "--out", tmp_path / "out"],
          "not a megatron dist checkpoint")
    fails(tmp_path, capsys, ["hf-to-mcore", "--hf", tmp_path / "nowhere", "--out", tmp_path / "out"],
          f"--hf: no config.json in {tmp_path / 'nowhere'}")  # the flag given, not the config key model.path
    # an index naming a file that is not there, then a truncated shard
    shard = model / "model.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    fails(tmp_path, capsys, to_mcore, "names 1 file(s) that are not there", "model-00001-of-00002.safetensors")
    (model / "model.safetensors.index.json").unlink()
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    fails(tmp_path, capsys, to_mcore, "truncated", "model.safetensors")
    shard.write_bytes(data)
    write_config(model, model_type="gpt2")
    fails(tmp_path, capsys, to_mcore, "model_type 'gpt2' is not supported", "qwen3_moe")
    write_config(model, model_type="llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    fails(tmp_path, capsys, to_mcore, "rope_scaling.rope_type 'dynamic'")


def test_output_directory_in_use_is_refused(tmp_path, capsys):
    model = make_hf_model(tmp_path / "model", "qwen3", seed=1)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "metadata.json").write_text("{}")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    for args in (["hf-to-mcore", "--hf", model], ["mcore-to-hf", "--ckpt", tmp_path / "ckpt", "--hf-config", model]):
        assert tool().main([str(a) for a in [*args, "--out", tmp_path / "out"]]) == 2
        assert "exists and is not empty" in capsys.readouterr().err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    # an --out under a file, or where this user cannot write: said before any tensor is read (a raw errno after)
    assert tool().main(["hf-to-mcore", "--hf", str(model), "--out", str(tmp_path / "out" / "keep.txt" / "x")]) == 2
    assert "keep.txt is a file, so no directory can be made under it" in capsys.readouterr().err
    if os.geteuid() != 0:  # (root writes anywhere)
        (tmp_path / "locked").mkdir(mode=0o500)
        assert tool().main(["hf-to-mcore", "--hf", str(model), "--out", str(tmp_path / "locked" / "ckpt")]) == 2
        assert "cannot write in" in capsys.readouterr().err


def peak_rss_mb(args) -> float:
    """Peak RSS of the converter alone (a wrapper process whose only child is the tool)."""
    code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 if r.returncode == 0 else -1)")
    proc = subprocess.run([sys.executable, "-c", code, sys.executable, TOOL, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    value = float(proc.stdout.strip().splitlines()[-1])
    assert value > 0, proc.stderr[-3000:]
    return value


def test_conversion_streams_with_a_peak_rss_far_below_the_model(tmp_path):
    """A 384 MB model (6 layers of 64 MB): both directions stay within the tool's own footprint
    (measured by a dry run, which imports and plans everything) plus three layers, where loading
    the model once would already cost 384 MB more. (Measured: +130 MB and +70 MB.)"""
    big = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
               intermediate_size=4096, num_hidden_layers=6)
    model = make_hf_model(tmp_path / "model", "qwen3", seed=1, **big)
    model_mb = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
    layer_mb = (4 * 1024 * 1024 + 3 * 1024 * 4096) * 4 / 2**20
    assert model_mb > 380
    base = peak_rss_mb(["hf-to-mcore", "--hf", model, "--out", tmp_path / "ckpt", "--dry-run"])
    to_mcore = peak_rss_mb(["hf-to-mcore", "--hf", model, "--out", tmp_path / "ckpt"])
    to_hf = peak_rss_mb(["mcore-to-hf", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "back", "--max-shard-gb", 0.1])
    print(f"model {model_mb:.0f} MB, layer {layer_mb:.0f} MB; peak RSS: dry run {base:.0f} MB, "
          f"hf→mcore {to_mcore:.0f} MB, mcore→hf {to_hf:.0f} MB")
    assert to_mcore - base < 3 * layer_mb
    assert to_hf - base < 3 * layer_mb  # 100 MB output shards: none waits in memory
    assert len(list((tmp_path / "back").glob("model-*-of-*.safetensors"))) > 3
    assert safetensors_bytes(tmp_path / "back") == safetensors_bytes(model)


def test_check_conversion_and_inspect(tmp_path, capsys):
    import importlib.util

    model = make_hf_model(tmp_path / "model", "qwen3_moe", seed=1)
    convert("hf-to-mcore", "--hf", model, "--out", tmp_path / "ckpt", "--ep", 2)
    ok = subprocess.run([sys.executable, "tools/check_conversion.py", "--hf", str(model), "--ckpt",
                         str(tmp_path / "ckpt")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr[-3000:]
    report = json.loads([line for line in ok.stdout.splitlines() if line.startswith("{")][-1])
    assert report["max_abs_logit_diff"] <= 1e-4 and abs(report["kl_per_token"]) <= 1e-6
    assert "check_conversion: PASS" in ok.stdout
    other = make_hf_model(tmp_path / "other", "qwen3_moe", seed=2)  # same shapes, other weights
    bad = subprocess.run([sys.executable, "tools/check_conversion.py", "--hf", str(other), "--ckpt",
                          str(tmp_path / "ckpt")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 1 and "check_conversion: FAIL" in bad.stdout
    # inspect: the same parameters counted from the HF headers and from the dist checkpoint's metadata
    spec = importlib.util.spec_from_file_location("inspect_checkpoint", ROOT / "tools/inspect_checkpoint.py")
    inspect = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(inspect)
    lines = {}
    for kind, path in (("hf", model), ("mcore", tmp_path / "ckpt")):
        assert inspect.main([str(path)]) == 0
        lines[kind] = capsys.readouterr().out.splitlines()
    numel = sum(t.numel()
                for t in __import__("safetensors.torch").torch.load_file(str(model / "model.safetensors")).values())
    for kind, out in lines.items():
        summary = next(line for line in out if line.startswith(f"{kind} checkpoint"))
        assert f"{numel:,} parameters" in summary and "(2 of 4 experts)" in summary, summary
    assert "model.layers.0.mlp.experts.3.down_proj.weight  [128, 48]  float32" in lines["hf"]
    assert "saved at tensor parallel 1 (linear_qkv in 1 row block(s) per layer)" in lines["mcore"]
    assert any("checked for layout {'tp': 1, 'pp': 1, 'ep': 2" in line for line in lines["mcore"])
    dense = make_hf_model(tmp_path / "dense", "qwen3", seed=1)  # another model's config: said, not a silent omission
    assert inspect.main([str(tmp_path / "ckpt"), "--summary", "--hf-config", str(dense)]) == 0
    assert (f"active per token unknown: the checkpoint has expert tensors and {dense / 'config.json'} is not an MoE "
            "model's") in capsys.readouterr().out


def test_bf16_checkpoint_round_trips_in_bf16(tmp_path):
    """Hub checkpoints are bf16 and sharded with an index: stored as bf16 in the dist checkpoint, and
    back bit for bit."""
    model = make_hf_model(tmp_path / "model", "qwen2_moe", seed=1, dtype=torch.bfloat16, max_shard_size="300KB")
    assert len(list(model.glob("model-*.safetensors"))) > 1 and (model / "model.safetensors.index.json").is_file()
    convert("hf-to-mcore", "--hf", model, "--out", tmp_path / "ckpt")
    convert("mcore-to-hf", "--ckpt", tmp_path / "ckpt", "--out", tmp_path / "back")
    original, back = safetensors_bytes(model), safetensors_bytes(tmp_path / "back")
    assert back == original and {d for d, _, _ in back.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"
    assert (tmp_path / "back" / "tokenizer.json").is_file() and (tmp_path / "back" / "generation_config.json").is_file()


def test_yarn_rope_tables_are_built_on_cpu_under_the_converters_meta_device(tmp_path):
    """hf-to-mcore builds the model under ``torch.device("meta")``; YaRN's frequencies mixed a meta arange with
    megatron's CPU ramp and the conversion of any YaRN model failed ("not on the expected device meta")."""
    from megarl.trainer.model import yarn_rope

    cfg = json.loads((make_hf_model(tmp_path / "yarn", "qwen2_yarn", seed=1) / "config.json").read_text())
    expected, factor = yarn_rope(cfg)
    with torch.device("meta"):
        inv_freq, factor_meta = yarn_rope(cfg)
    assert inv_freq.device.type == "cpu" and torch.equal(inv_freq, expected) and factor_meta == factor


def test_layout_flags_out_of_range_are_refused_naming_the_flag(tmp_path, capsys):
    """--tp/--pp/--ep/--vpp 0 crashed with ZeroDivisionError; --tp -2 and --etp 2 on a dense
    model were accepted (and would be recorded in the checkpoint)."""
    dense = make_hf_model(tmp_path / "dense", "qwen3", seed=1)
    moe = make_hf_model(tmp_path / "moe", "qwen3_moe", seed=1)
    for flag in ("tp", "pp", "ep", "vpp"):
        fails(tmp_path, capsys, ["hf-to-mcore", "--hf", moe, "--out", tmp_path / "out", f"--{flag}", 0, "--dry-run"],
              f"--{flag} 0: must be >= 1")
    fails(tmp_path, capsys, ["hf-to-mcore", "--hf", moe, "--out", tmp_path / "out", "--tp", -2, "--dry-run"],
          "--tp -2: must be >= 1")
    fails(tmp_path, capsys, ["hf-to-mcore", "--hf", moe, "--out", tmp_path / "out", "--etp", -1, "--dry-run"],
          "--etp -1: must be >= 0")
    fails(tmp_path, capsys, ["hf-to-mcore", "--hf", dense, "--out", tmp_path / "out", "--etp", 2, "--dry-run"],
          "--etp 2 needs an MoE model", "leave --etp at 0")


def test_a_model_with_only_pytorch_model_bin_is_refused_naming_it(tmp_path, capsys):
    """a hub model saved as pytorch_model.bin: the converter, the trainer's reader and
    ``megarl train``'s check before launch (vLLM would load it, the trainer would not) say the same."""
    from safetensors.torch import load_file

    from megarl.cli import main as megarl
    from megarl.models.hf_config import read_hf_config
    from megarl.models.hf_slices import ShardReader

    model = make_hf_model(tmp_path / "model", "qwen3", seed=1)
    torch.save(load_file(str(model / "model.safetensors")), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    said = ("pytorch_model.bin, a format megarl does not read", "megarl reads safetensors only",
            "save_pretrained")
    fails(tmp_path, capsys, ["hf-to-mcore", "--hf", model, "--out", tmp_path / "out"], *said)
    with pytest.raises(FileNotFoundError) as exc:
        ShardReader(model, read_hf_config(model))
    assert all(text in str(exc.value) for text in said)
    status = megarl(["train", "--config", str(ROOT / "configs/demo.yaml"), f"model.path={model}",
                     f"train.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert status == 2 and "megarl: config error: model.path: no *.safetensors" in err, err
    assert all(text in err for text in said) and not (tmp_path / "run").exists()
