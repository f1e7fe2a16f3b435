"""HF checkpoint directories read one tensor, or one range of a tensor's rows, at a time (safetensors, sharded
with an index).

``HFCheckpoint`` reads only the safetensors headers up front (names, dtypes, shapes, byte ranges)
and checks them — every file an index names exists, no file is shorter than its header says —
before anything is read; ``read(name)`` then reads that one tensor with a plain file read (no
memory map, so the page cache is not counted in this process's memory: the memory in use is the
tensor, not the file), and ``read_rows(name, start, stop)`` reads only the bytes of rows
``[start, stop)`` of its leading dimension (a safetensors tensor is row-major, so they are one
contiguous byte range), into a given tensor when asked, with no copy in between.

It sits in ``models/`` beside the name and shard maps rather than in ``convert/`` so that the trainer (below
``convert`` in the import order) reads its shards through it (``models/hf_slices.py``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from megarl.models.hf_config import missing_safetensors

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
INDEX = "model.safetensors.index.json"


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
                raise FileNotFoundError(missing_safetensors(self.path))
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
        """The whole tensor ``name``."""
        file, dtype, shape, offset, nbytes = self.entries[name]
        out = torch.empty(shape, dtype=dtype)
        _read_into(file, offset, out, name)
        return out

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``name``'s leading dimension, reading only their bytes; into ``out`` (contiguous,
        of the tensor's dtype and of shape ``(stop - start, *shape[1:])``) when given."""
        file, dtype, shape, offset, _ = self.entries[name]
        if not shape or not 0 <= start <= stop <= shape[0]:
            raise ValueError(f"{file}: rows [{start}, {stop}) of {name}, which has shape {shape}")
        want = (stop - start, *shape[1:])
        if out is None:
            out = torch.empty(want, dtype=dtype)
        elif tuple(out.shape) != want or out.dtype != dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"rows [{start}, {stop}) of {name} ({dtype}) cannot be read into a "
                             f"{'' if out.is_contiguous() else 'non-contiguous '}{out.dtype} tensor of shape "
                             f"{tuple(out.shape)} on {out.device}: want {want}")
        row_bytes = out[0].numel() * dtype.itemsize if stop > start else 0
        _read_into(file, offset + start * row_bytes, out, name)
        return out


def _read_into(file: Path, offset: int, out: torch.Tensor, name: str) -> None:
    """Fill the contiguous CPU tensor ``out`` with the bytes of ``file`` from ``offset`` (a read may come back
    short: one system call reads at most ~2 GiB)."""
    view = memoryview(out.detach().reshape(-1).view(torch.uint8).numpy())
    done = 0
    with open(file, "rb", buffering=0) as f:
        f.seek(offset)
        while done < len(view):
            got = f.readinto(view[done:])
            if not got:
                raise ValueError(f"{file}: truncated while reading {name}")
            done += got
