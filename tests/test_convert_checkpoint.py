"""tools/convert_checkpoint.py: HF → megatron → (trainer at a layout) → megatron → HF, bit for bit.

Models come from transformers' own ``from_config`` + ``save_pretrained`` (``tests/hf_models.py``).
"""

import json
import subprocess
import sys

import pytest
import torch
from hf_models import make_hf_model

from conftest import ROOT, run_script

TOOL = "tools/convert_checkpoint.py"


def convert(*args, check=True):
    proc = subprocess.run([sys.executable, TOOL, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


def safetensors_bytes(path):
    """name → (dtype, shape, raw bytes) over every shard of an HF directory."""
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                out[name] = (t.dtype, tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return out


def hf_logprobs(path, vocab):
    from parallel_checks import fixed_batch
    from transformers import AutoModelForCausalLM

    batch = fixed_batch(vocab, seq=40)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch.input_ids).logits
    return torch.log_softmax(logits.float(), -1).gather(-1, batch.labels.unsqueeze(-1)).squeeze(-1), batch.loss_mask


LAYOUTS = {"single": (), "tp2": ("--tp", 2), "pp2": ("--pp", 2), "ep2_alltoall": ("--ep", 2),
           "tp2_sp": ("--tp", 2), "pp2_vpp2": ("--pp", 2, "--vpp", 2), "tp2_pp2": ("--tp", 2, "--pp", 2),
           "tp2_sp_pp2": ("--tp", 2, "--pp", 2)}
DEFAULT = [("llama_tied_llama3", "pp2"), ("qwen3_moe", "ep2_alltoall")]
SLOW = [(f, lay) for f in ("llama_tied_llama3", "mistral") for lay in ("single", "tp2", "tp2_pp2", "pp2_vpp2")]
SLOW += [("mistral", "pp2")]
SLOW += [(f, lay) for f in ("qwen3_moe", "mixtral", "qwen2_moe")
         for lay in ("single", "tp2_sp", "pp2", "tp2_sp_pp2", "pp2_vpp2", "ep2_alltoall")]
SLOW.remove(("qwen3_moe", "ep2_alltoall"))


def round_trip(tmp_path, family, layout):
    model = make_hf_model(tmp_path / "model", family, seed=1)
    other = make_hf_model(tmp_path / "other", family, seed=2)
    convert("hf-to-mcore", "--hf", model, "--out", tmp_path / "ckpt", *LAYOUTS[layout])
    assert not (tmp_path / "ckpt.tmp").exists()
    nproc = 4 if "tp2" in layout and "pp2" in layout else 2
    launcher = [] if layout == "single" else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    run_script([*launcher, "tests/conversion_checks.py", layout, str(other), str(tmp_path / "ckpt"), str(tmp_path)],
               env={"OMP_NUM_THREADS": "1"})
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
