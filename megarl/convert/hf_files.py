"""HF checkpoint directories written one tensor at a time (safetensors, sharded with an index); they are read by
``megarl/models/hf_reader.py``'s ``HFCheckpoint`` (in ``models/`` so that the trainer, below ``convert``, reads its
shards through it).

``ShardedWriter`` is given the whole plan (names, shapes, dtypes) first, cuts it into shards of at most
``max_shard_bytes`` in plan order, writes each shard's header from the plan and each tensor at its offset as it
arrives.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import torch

from megarl.models.hf_reader import DTYPES, INDEX

# Files copied beside converted weights (config, generation config, tokenizer and chat template).
AUX_FILES = re.compile(r"^(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|vocab|merges|"
                       r"added_tokens|chat_template|preprocessor_config)\.(json|txt|model|jinja)$|^tokenizer\.model$")


def staging_dir(out: Path) -> Path:
    """``out``'s sibling ``<name>.tmp``, empty: where a checkpoint is written before ``publish`` names it ``out``."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def publish(tmp: Path, out: Path) -> Path:
    """The complete ``tmp`` renamed to ``out`` (an older ``out`` removed first): a directory named ``out`` is always
    whole."""
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def copy_aux_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy config, generation config and tokenizer files of ``src`` into ``dst``."""
    copied = []
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and AUX_FILES.match(f.name):
            shutil.copy2(f, Path(dst) / f.name)
            copied.append(f.name)
    return copied


def nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * dtype.itemsize


class ShardedWriter:
    """Write HF-named tensors as ``model-0000k-of-0000N.safetensors`` + index, tensor by tensor.

    ``plan``: (name, shape, dtype) in the order the tensors will be added. The plan fixes each
    shard's safetensors header (names, dtypes, shapes, byte offsets) in advance, so every tensor
    is written at its place the moment it arrives and nothing waits in memory."""

    def __init__(self, out: str | Path, plan: list[tuple[str, tuple, torch.dtype]], max_shard_bytes: int) -> None:
        self.out = Path(out)
        shards: list[list[tuple[str, tuple, torch.dtype]]] = [[]]
        size = 0
        for name, shape, dtype in plan:
            b = nbytes(shape, dtype)
            if shards[-1] and size + b > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(shape), dtype))
            size += b
        n = len(shards)
        self.files = (["model.safetensors"] if n == 1
                      else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        self.shard_of = {name: i for i, names in enumerate(shards) for name, _, _ in names}
        self.layout: dict[str, tuple[int, tuple, torch.dtype]] = {}  # name → (absolute offset, shape, dtype)
        self.headers: list[bytes] = []
        names = {v: k for k, v in DTYPES.items()}
        for entries in shards:
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for name, shape, dtype in entries:
                header[name] = {"dtype": names[dtype], "shape": list(shape),
                                "data_offsets": [offset, offset + nbytes(shape, dtype)]}
                offset += nbytes(shape, dtype)
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
            self.headers.append(struct.pack("<Q", len(raw)) + raw)
            for name, shape, dtype in entries:
                self.layout[name] = (len(self.headers[-1]) + header[name]["data_offsets"][0], shape, dtype)
        self.waiting = [{name for name, _, _ in entries} for entries in shards]
        self.handles: dict[int, object] = {}
        self.total = sum(nbytes(s, d) for _, s, d in plan)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.shard_of:
            raise KeyError(f"tensor {name} is not in the conversion plan")
        offset, shape, dtype = self.layout[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, planned {shape} {dtype}")
        i = self.shard_of[name]
        if i not in self.handles:
            self.handles[i] = open(self.out / self.files[i], "wb", buffering=0)
            self.handles[i].write(self.headers[i])
        f = self.handles[i]
        f.seek(offset)
        f.write(memoryview(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()))
        self.waiting[i].discard(name)
        if not self.waiting[i]:
            self.handles.pop(i).close()

    def finish(self) -> None:
        for f in self.handles.values():
            f.close()
        left = sorted(n for w in self.waiting for n in w)
        if left:
            raise RuntimeError(f"conversion produced no tensor for {left[:5]}")
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {name: self.files[i] for name, i in sorted(self.shard_of.items())}}
            (self.out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
