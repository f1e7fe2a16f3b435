"""What transformers' GGUF reader leaves out of the HF config and tokenizer, read back from the GGUF file itself.

transformers 5 maps a fixed table of GGUF keys; a file can carry more, and what is not mapped silently takes the
HF class's default. Three such gaps change the model megarl would train:

- **llama3 RoPE scaling** (Llama 3.1/3.2) has no metadata key: llama.cpp's converter stores it as
  ``rope_freqs.weight``, the divisor of each rotary frequency. ``llama3_rope`` rebuilds ``rope_parameters``
  (factor, low/high_freq_factor, original_max_position_embeddings) from those divisors, preferring
  ``rope.scaling.factor`` / ``rope.scaling.original_context_length`` where the file has them, and keeps only a
  rebuild under which transformers' own llama3 frequencies give back every divisor; other scaling kinds a file
  can name (``rope.scaling.type``) are taken (linear) or refused.
- **MoE expert sizes**: ``expert_feed_forward_length`` and ``expert_shared_feed_forward_length`` become
  ``moe_intermediate_size`` / ``shared_expert_intermediate_size``, checked against the expert tensors' shapes.
- **The pre-tokenizer**: a ``tokenizer.ggml.pre`` transformers has no split for falls back to GPT-2's regex.
  ``pre_tokenizer`` gives the model's own for the names megarl's models use (SmolLM2's ``smollm``: every digit
  its own pre-token, as its tokenizer.json and llama.cpp both split).

Every refusal names the file and the key.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

ROPE_TOLERANCE = 1e-4
"""Relative agreement asked of a rebuilt llama3 RoPE with the file's ``rope_freqs`` (stored as F32)."""


def metadata(reader, key: str, default=None):
    """One metadata value of a ``GGUFReader`` (a scalar or a string), ``default`` when the file lacks it."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def tensor_shapes(reader) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape as numpy (and transformers) orders it: GGUF stores dimensions innermost first."""
    return {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in reader.tensors}


def moe_sizes(path: Path, reader, arch: str) -> dict[str, int]:
    """``moe_intermediate_size`` (and Qwen2-MoE's ``shared_expert_intermediate_size``) of an MoE file: from
    ``expert_feed_forward_length`` / ``expert_shared_feed_forward_length``, which must match the expert tensors."""
    shapes = tensor_shapes(reader)
    sizes = {}
    for hf_key, gguf_key, tensor in (("moe_intermediate_size", "expert_feed_forward_length", "blk.0.ffn_gate_exps"),
                                     ("shared_expert_intermediate_size", "expert_shared_feed_forward_length",
                                      "blk.0.ffn_gate_shexp")):
        stated = metadata(reader, f"{arch}.{gguf_key}")
        shape = shapes.get(f"{tensor}.weight")
        if shape is None:
            if stated is not None and tensor.endswith("exps"):
                raise ValueError(f"{path}: {arch}.{gguf_key} is {stated} but the file has no {tensor}.weight")
            continue
        if stated is not None and int(stated) != shape[-2]:
            raise ValueError(f"{path}: {arch}.{gguf_key} is {stated} but {tensor}.weight has {shape[-2]} rows; "
                             f"the file is inconsistent")
        sizes[hf_key] = int(shape[-2])
    dense = [i for i in range(int(metadata(reader, f"{arch}.block_count", 0)))
             if f"blk.{i}.ffn_gate_exps.weight" not in shapes]
    if dense:
        raise ValueError(f"{path}: layer {dense[0]} has no routed experts (no blk.{dense[0]}.ffn_gate_exps.weight); "
                         f"megarl imports {arch} files whose every layer has experts, as llama.cpp writes them")
    return sizes


def _llama3_candidates(divisors: np.ndarray, wavelen: np.ndarray, factor: float, original: int | None):
    """(low_freq_factor, high_freq_factor, original_max_position_embeddings) that may have produced ``divisors``.

    Between the two thresholds llama3 blends: 1/divisor = (1 - s)/factor + s with s = (L/wavelen - low)/(high -
    low), a line in 1/wavelen. Its slope L/(high - low) and intercept -low/(high - low) fix L up to one common
    scale, settled by the file's original context length or, failing that, by low = 1 (Llama 3's own choice).
    Then Llama 3's published values (low 1, high 4, L 8192) as a last guess."""
    blend = (divisors > 1 + ROPE_TOLERANCE) & (divisors < factor * (1 - ROPE_TOLERANCE))
    if blend.sum() >= 2:
        s = (1 / divisors[blend] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[blend], s, 1)
        if intercept < 0 < slope:
            # L: the file's, or the one low = 1 gives, made whole (the thresholds' wavelengths kept)
            length = int(original or round(slope * -1 / intercept))
            span = length / slope
            yield round(-intercept * span, 6), round((1 - intercept) * span, 6), length
    yield 1.0, 4.0, int(original or 8192)


def llama3_rope(path: Path, reader, arch: str, config) -> dict | None:
    """The ``rope_parameters`` of a file's RoPE scaling (None: plain RoPE), checked against ``rope_freqs``."""
    import torch
    from gguf import dequantize
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = metadata(reader, f"{arch}.rope.scaling.type", "none")
    theta = float(metadata(reader, f"{arch}.rope.freq_base", 10000.0))
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        if kind == "none":
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(metadata(reader, f"{arch}.rope.scaling.factor")),
                    "rope_theta": theta}
        raise ValueError(f"{path}: {arch}.rope.scaling.type {kind!r} is not imported; importable: none, linear, "
                         f"and llama3 (as rope_freqs.weight)")
    if arch != "llama" or kind != "none":
        raise ValueError(f"{path}: rope_freqs.weight on a {arch} file with {arch}.rope.scaling.type {kind!r}; "
                         "megarl imports it only as llama3 scaling of a llama file (rope.scaling.type none)")
    divisors = np.asarray(dequantize(freqs.data, freqs.tensor_type), dtype=np.float64).reshape(-1)
    dim = 2 * divisors.size
    if np.allclose(divisors, 1.0, rtol=0, atol=ROPE_TOLERANCE):
        return None  # all ones: no scaling
    base = theta ** -(np.arange(0, dim, 2) / dim)
    factor = float(metadata(reader, f"{arch}.rope.scaling.factor", 0.0)) or float(divisors.max())
    original = metadata(reader, f"{arch}.rope.scaling.original_context_length")
    tried = []
    for low, high, original_len in _llama3_candidates(divisors, 2 * math.pi / base, factor, original):
        rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": original_len, "rope_theta": theta}
        config.rope_parameters = rope
        inv_freq = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))[0].double().numpy()
        if inv_freq.shape == base.shape and np.allclose(base / inv_freq, divisors, rtol=ROPE_TOLERANCE, atol=0):
            return rope
        tried.append(f"low_freq_factor {low}, high_freq_factor {high}, original_max_position_embeddings "
                     f"{original_len}")
    raise ValueError(f"{path}: rope_freqs.weight ({divisors.size} divisors, max {divisors.max():g}) is not a llama3 "
                     f"RoPE scaling that transformers reproduces (tried factor {factor:g} with "
                     f"{'; '.join(tried)}); the converted model would rotate positions differently from the file")


def pre_tokenizer(name: str):
    """The model's own pre-tokenizer for a GGUF ``tokenizer.ggml.pre`` transformers maps to GPT-2's split, or
    None to keep transformers' choice."""
    from tokenizers import pre_tokenizers

    if name == "smollm":  # SmolLM/SmolLM2's tokenizer.json: digits one by one, then GPT-2's byte-level split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                                                 use_regex=True)])
    return None

