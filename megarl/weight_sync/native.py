"""The weight-sync kernels of ``csrc/`` and the pure-torch reference of each; this module picks.

Four ops, each with the same signature on every path (outputs are preallocated, contiguous, and
may have another dtype than the input: the cast happens on the way):

- ``pack(srcs, dst)``: the flattened ``srcs`` one after another into the 1-D bucket ``dst``;
- ``unpack(src, dsts)``: the inverse;
- ``split_qkv(qkv, groups, q, k, v)``: Megatron's fused QKV, per query group [q heads, k, v],
  group-major (TP shards concatenated along dim 0 keep that order), into HF q / k / v;
- ``split_gate_up(fc1, shards, gate, up)``: Megatron's ``linear_fc1`` gathered over ``shards`` TP
  ranks, each cat(gate shard, up shard), into HF gate / up.

Paths: a CUDA tensor goes to ``csrc/cuda`` (plain CUDA C++ loaded with ctypes, called with
``data_ptr()`` and the current stream), a CPU tensor to ``csrc/cpu`` (torch ops
``megarl_native::*``, OpenMP), and either falls back to the reference when its library is absent.
``MEGARL_NATIVE`` chooses: ``auto`` (default) uses libraries already built (``make kernels``) and
never compiles, ``jit`` builds what is missing (cached in ``MEGARL_NATIVE_DIR``,
``~/.cache/megarl/native`` by default), ``off`` always uses the reference. The install itself
never compiles anything.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("megarl.weight_sync.native")  # by name: run as `python -m`, __name__ is "__main__"

CSRC = Path(__file__).resolve().parents[2] / "csrc"
CPU_SOURCES = [CSRC / "cpu" / "weight_sync_ops.cpp"]
CUDA_SOURCE = CSRC / "cuda" / "weight_sync_kernels.cu"
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NVCC_ARCH = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
             "-gencode", "arch=compute_90,code=compute_90"]
MODES = ("auto", "jit", "off")


def mode() -> str:
    m = os.environ.get("MEGARL_NATIVE", "auto")
    if m not in MODES:
        raise ValueError(f"MEGARL_NATIVE={m!r}: expected one of {', '.join(MODES)}")
    return m


def build_dir() -> Path:
    return Path(os.environ.get("MEGARL_NATIVE_DIR", Path.home() / ".cache" / "megarl" / "native"))


# ---------------------------------------------------------------------------------------------
# References (pure torch). Same signatures as the kernels; the casts are torch's own copy_.


def pack_reference(srcs: list[torch.Tensor], dst: torch.Tensor) -> None:
    offset = 0
    for t in srcs:
        dst[offset:offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()


def unpack_reference(src: torch.Tensor, dsts: list[torch.Tensor]) -> None:
    offset = 0
    for t in dsts:
        t.copy_(src[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()


def split_qkv_reference(qkv: torch.Tensor, groups: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    grouped = qkv.reshape(groups, -1)
    qg, kg = q.numel() // groups, k.numel() // groups
    q.view(groups, qg).copy_(grouped[:, :qg])
    k.view(groups, kg).copy_(grouped[:, qg:qg + kg])
    v.view(groups, kg).copy_(grouped[:, qg + kg:])


def split_gate_up_reference(fc1: torch.Tensor, shards: int, gate: torch.Tensor, up: torch.Tensor) -> None:
    halves = fc1.reshape(shards, 2, -1)
    gate.view(shards, -1).copy_(halves[:, 0])
    up.view(shards, -1).copy_(halves[:, 1])


REFERENCE = {"pack": pack_reference, "unpack": unpack_reference, "split_qkv": split_qkv_reference,
             "split_gate_up": split_gate_up_reference}


# ---------------------------------------------------------------------------------------------
# Building and loading.


def build_cpu(verbose: bool = False) -> Path:
    """JIT-build (or find, cached by source hash) the CPU ops library and load it; returns its path."""
    from torch.utils.cpp_extension import load

    out = build_dir() / "cpu"
    out.mkdir(parents=True, exist_ok=True)
    # -fopenmp in cflags AND ldflags: without it at::parallel_for silently runs on one thread.
    load(name="megarl_native", sources=[str(s) for s in CPU_SOURCES], build_directory=str(out),
         extra_cflags=["-O3", "-g0", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False,
         verbose=verbose)
    return out / "megarl_native.so"


def nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").is_file():
        found = "/usr/local/cuda/bin/nvcc"
    return found


def nvcc_command(out: str, shared: bool) -> list[str]:
    exe = nvcc()
    if exe is None:
        raise FileNotFoundError("nvcc not found (PATH or /usr/local/cuda/bin): the CUDA kernels cannot be built")
    flags = ["-shared", "-Xcompiler", "-fPIC"] if shared else ["-c"]
    return [exe, "-std=c++17", "-O3", *NVCC_ARCH, "-Xcompiler", "-Wall,-Wextra", "-Werror", "all-warnings",
            *flags, str(CUDA_SOURCE), "-o", out]


def build_cuda() -> Path:
    """Compile the CUDA kernels into a shared library (plain nvcc, no torch headers); returns its path."""
    out = build_dir() / "cuda" / "libmegarl_cuda.so"
    if _fresh(out, [CUDA_SOURCE]):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run(nvcc_command(str(tmp), shared=True), check=True, capture_output=True, text=True)
    tmp.replace(out)
    return out


def _fresh(lib: Path, sources: list[Path]) -> bool:
    """A library newer than its sources (or, in an install without ``csrc/``, any library)."""
    stamps = [s.stat().st_mtime for s in sources if s.is_file()]
    return lib.is_file() and lib.stat().st_mtime >= max(stamps, default=0.0)


@cache
def cpu_ops():
    """``torch.ops.megarl_native`` when the CPU library is (or, under ``jit``, can be) loaded, else None."""
    m = mode()
    if m == "off":
        return None
    lib = build_dir() / "cpu" / "megarl_native.so"
    try:
        if m == "jit":
            build_cpu()
        elif _fresh(lib, CPU_SOURCES):
            torch.ops.load_library(str(lib))
        else:
            log.info("megarl.weight_sync.native: no CPU kernels built (make kernels); using the torch reference")
            return None
    except Exception as e:  # a failed build degrades to the reference, loudly
        log.warning("megarl.weight_sync.native: CPU kernels unavailable (%s); using the torch reference", e)
        return None
    return torch.ops.megarl_native


@cache
def cuda_lib():
    """The ctypes handle of the CUDA kernels when built (or, under ``jit``, buildable), else None."""
    m = mode()
    if m == "off" or not torch.cuda.is_available():
        return None
    lib = build_dir() / "cuda" / "libmegarl_cuda.so"
    try:
        if m == "jit":
            lib = build_cuda()
        elif not _fresh(lib, [CUDA_SOURCE]):
            return None
        handle = ctypes.CDLL(str(lib))
    except Exception as e:
        log.warning("megarl.weight_sync.native: CUDA kernels unavailable (%s); using the torch reference", e)
        return None
    i64, vp, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    handle.megarl_copy_segments.argtypes = [vp, i32, i64, vp]
    handle.megarl_split_qkv.argtypes = [vp, i32, vp, i32, vp, i32, vp, i32, i64, i64, i64, vp]
    handle.megarl_split_gate_up.argtypes = [vp, i32, vp, i32, vp, i32, i64, i64, vp]
    return handle


# ---------------------------------------------------------------------------------------------
# CUDA calls through ctypes.


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _check(err: int, what: str) -> None:
    if err != 0:
        raise RuntimeError(f"megarl CUDA kernel {what} failed to launch (cudaError {err})")


def _kind(t: torch.Tensor) -> int:
    if t.dtype not in KINDS:
        raise TypeError(f"dtype {t.dtype} is not one of float32, bfloat16, float16")
    return KINDS[t.dtype]


def _cuda_segments(lib, rows: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    """rows: (src, dst, n) with src / dst the addresses' tensors (already offset views)."""
    meta = torch.tensor([[s.data_ptr(), d.data_ptr(), n, _kind(s) | _kind(d) << 8] for s, d, n in rows],
                        dtype=torch.int64).to(rows[0][1].device)
    # ``meta`` may be freed on return: the caching allocator reuses it only after this stream's launch.
    _check(lib.megarl_copy_segments(meta.data_ptr(), len(rows), max(n for _, _, n in rows), _stream()),
           "copy_segments")


def _pack_cuda(lib, srcs, dst):
    rows, offset = [], 0
    for t in srcs:
        rows.append((t, dst[offset:offset + t.numel()], t.numel()))
        offset += t.numel()
    if rows:
        _cuda_segments(lib, rows)


def _unpack_cuda(lib, src, dsts):
    rows, offset = [], 0
    for t in dsts:
        rows.append((src[offset:offset + t.numel()], t, t.numel()))
        offset += t.numel()
    if rows:
        _cuda_segments(lib, rows)


def _split_qkv_cuda(lib, qkv, groups, q, k, v):
    _check(lib.megarl_split_qkv(qkv.data_ptr(), _kind(qkv), q.data_ptr(), _kind(q), k.data_ptr(), _kind(k),
                                v.data_ptr(), _kind(v), groups, q.numel() // groups, k.numel() // groups, _stream()),
           "split_qkv")


def _split_gate_up_cuda(lib, fc1, shards, gate, up):
    _check(lib.megarl_split_gate_up(fc1.data_ptr(), _kind(fc1), gate.data_ptr(), _kind(gate), up.data_ptr(),
                                    _kind(up), shards, gate.numel() // shards, _stream()), "split_gate_up")


_CUDA = {"pack": _pack_cuda, "unpack": _unpack_cuda, "split_qkv": _split_qkv_cuda, "split_gate_up": _split_gate_up_cuda}


# ---------------------------------------------------------------------------------------------
# The public ops.


def backend(device: torch.device | str = "cpu") -> str:
    """Which path an op on ``device`` takes: ``native`` or ``reference``."""
    kind = torch.device(device).type
    return "native" if (cuda_lib() if kind == "cuda" else cpu_ops()) is not None else "reference"


def _check_shapes(name: str, args: tuple) -> None:
    if name == "split_qkv":
        qkv, groups, q, k, v = args
        if qkv.numel() != q.numel() + k.numel() + v.numel() or q.numel() % groups or k.numel() % groups:
            raise ValueError(f"split_qkv: qkv {tuple(qkv.shape)} is not {groups} groups of q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    elif name == "split_gate_up":
        fc1, shards, gate, up = args
        if fc1.numel() != gate.numel() + up.numel() or gate.numel() != up.numel() or gate.numel() % shards:
            raise ValueError(f"split_gate_up: fc1 {tuple(fc1.shape)} is not {shards} shards of gate "
                             f"{tuple(gate.shape)} + up {tuple(up.shape)}")


def _call(name: str, device: torch.device, *args) -> None:
    _check_shapes(name, args)
    if device.type == "cuda":
        lib = cuda_lib()
        if lib is not None:
            return _CUDA[name](lib, *args)
    elif device.type == "cpu":
        ops = cpu_ops()
        if ops is not None:
            return getattr(ops, name)(*args)
    return REFERENCE[name](*args)


def pack(srcs: list[torch.Tensor], dst: torch.Tensor) -> None:
    _call("pack", dst.device, [t.contiguous() for t in srcs], dst)


def unpack(src: torch.Tensor, dsts: list[torch.Tensor]) -> None:
    _call("unpack", src.device, src.contiguous(), dsts)


def split_qkv(qkv: torch.Tensor, groups: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _call("split_qkv", qkv.device, qkv.contiguous(), groups, q, k, v)


def split_gate_up(fc1: torch.Tensor, shards: int, gate: torch.Tensor, up: torch.Tensor) -> None:
    _call("split_gate_up", fc1.device, fc1.contiguous(), shards, gate, up)


def main() -> None:
    """``python -m megarl.weight_sync.native``: build every kernel this machine can build (``make kernels``)."""
    print("cpu kernels:", build_cpu(verbose=False))
    if nvcc() is None:
        print("cuda kernels: skipped (no nvcc)")
    else:
        print("cuda kernels:", build_cuda())


if __name__ == "__main__":
    main()
