"""HF checkpoint directories read and written one tensor at a time (safetensors, sharded with an index).

``HFCheckpoint`` reads only the safetensors headers up front (names, dtypes, shapes, byte ranges)
and checks them — every file an index names exists, no file is shorter than its header says —
before anything is converted; ``read(name)`` then reads that one tensor with a plain file read
(no memory map), so the memory in use is the tensor, not the file. ``ShardedWriter`` is given the
whole plan (names, shapes, dtypes) first, cuts it into shards of at most ``max_shard_bytes`` in
plan order, writes each shard's header from the plan and each tensor at its offset as it arrives.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
INDEX = "model.safetensors.index.json"
# Files copied beside converted weights (config, generation config, tokenizer and chat template).
AUX_FILES = re.compile(r"^(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|vocab|merges|"
                       r"added_tokens|chat_template|preprocessor_config)\.(json|txt|model|jinja)$|^tokenizer\.model$")


class HFCheckpoint:
    """The tensors of an HF checkpoint directory, by name, without loading them."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(f"{self.path}: no config.json (not an HF checkpoint directory)")
        index = self.path / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.path / f).is_file()]
            if missing:
                raise FileNotFoundError(f"{index} names {len(missing)} file(s) that are not there: {missing[:3]}")
        else:
            files = sorted(f.name for f in self.path.glob("*.safetensors"))
            weight_map = None
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in model directory {self.path}")
        self.entries: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int, int]] = {}
        for name in files:
            self._read_header(self.path / name)
        if weight_map is not None:
            absent = sorted(set(weight_map) - set(self.entries))
            if absent:
                raise KeyError(f"{index} lists tensors that no shard holds: {absent[:3]}")

    def _read_header(self, file: Path) -> None:
        size = file.stat().st_size
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{file}: truncated ({size} bytes; not a safetensors file)")
            (n,) = struct.unpack("<Q", raw)
            if 8 + n > size:
                raise ValueError(f"{file}: truncated (header of {n} bytes, file of {size})")
            header = json.loads(f.read(n))
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            if base + end > size:
                raise ValueError(f"{file}: truncated: tensor {name} ends at byte {base + end}, the file has {size}")
            if info["dtype"] not in DTYPES:
                raise ValueError(f"{file}: tensor {name} has dtype {info['dtype']}; supported: {', '.join(DTYPES)}")
            self.entries[name] = (file, DTYPES[info["dtype"]], tuple(info["shape"]), base + start, end - start)

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor of ``name``'s shape and dtype (for planning without reading)."""
        _, dtype, shape, _, _ = self.entries[name]
        return torch.empty(shape, dtype=dtype, device="meta")

    def read(self, name: str) -> torch.Tensor:
        file, dtype, shape, offset, nbytes = self.entries[name]
        out = torch.empty(nbytes, dtype=torch.uint8)
        with open(file, "rb") as f:
            f.seek(offset)
            if f.readinto(out.numpy()) != nbytes:
                raise ValueError(f"{file}: truncated while reading {name}")
        return out.view(dtype).reshape(shape)


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
