"""csrc/ kernels against their pure-torch references, bit for bit (NaN-aware).

The CPU kernels are JIT-built here (cached in ``MEGARL_NATIVE_DIR``); the CUDA file is
compile-checked with nvcc and its launchers called through ctypes; ``gpu`` tests run the
CUDA kernels on a GPU.
"""

from __future__ import annotations

import ctypes
import subprocess

import pytest
import torch

from megarl.models.hf_adapter import qkv_from_megatron
from megarl.models.sharding import join_tp_shards
from megarl.weight_sync import native

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.fixture(scope="module")
def ops():
    native.build_cpu()  # JIT, cached by source hash: seconds the first time, instant after
    return torch.ops.megarl_native


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same dtype, shape and bits; NaNs only need to be NaN in both (payloads differ by path)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    assert torch.equal(nan_a, nan_b)
    same = a.view(_BITS[a.dtype]) == b.view(_BITS[b.dtype])
    assert bool((same | nan_a).all()), f"{int((~same & ~nan_a).sum())} elements differ"


def awkward(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values at many scales plus the cases rounding gets wrong: ties, inf, NaN, -0, subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, -3e-39, 65504.0, 7e4,
                            1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-11, 6e-8, 3.4e38])
    x[: min(n, len(special))] = special[: min(n, len(special))]
    return x.to(dtype)


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
def test_pack_and_unpack_equal_the_reference_bit_for_bit(ops, src_dtype, dst_dtype):
    sizes = [0, 1, 7, 4096, 3, 200_003, 65_536, 5]  # one larger than a parallel grain, an empty one
    srcs = [awkward(n, src_dtype, seed=i).reshape(-1, 1) if n % 2 else awkward(n, src_dtype, seed=i)
            for i, n in enumerate(sizes)]
    total = sum(sizes)
    got, ref = torch.full((total + 3,), 7.0, dtype=dst_dtype), torch.full((total + 3,), 7.0, dtype=dst_dtype)
    ops.pack(srcs, got)
    native.pack_reference(srcs, ref)
    assert_bits_equal(got, ref)
    assert torch.equal(got[-3:], torch.full((3,), 7.0, dtype=dst_dtype))  # nothing written past the tensors
    outs_got = [torch.empty_like(s) for s in srcs]
    outs_ref = [torch.empty_like(s) for s in srcs]
    ops.unpack(got, outs_got)
    native.unpack_reference(ref, outs_ref)
    for a, b in zip(outs_got, outs_ref):
        assert_bits_equal(a, b)


def test_pack_matches_torch_cat_of_the_cast_tensors(ops):
    srcs = [awkward(n, torch.float32, seed=n) for n in (1000, 33, 70_000)]
    bucket = torch.empty(sum(t.numel() for t in srcs), dtype=torch.bfloat16)
    ops.pack(srcs, bucket)
    assert_bits_equal(bucket, torch.cat([t.to(torch.bfloat16) for t in srcs]))


@pytest.mark.parametrize("heads,kv,d,tp", [(4, 2, 8, 1), (8, 2, 16, 2), (6, 6, 4, 3), (16, 1, 8, 1)])
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
def test_split_qkv_is_the_adapters_layout(ops, heads, kv, d, tp, dst_dtype):
    hidden = 24
    cfg = {"num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d, "hidden_size": hidden}
    for shape in ((kv * (heads // kv + 2) * d, hidden), (kv * (heads // kv + 2) * d,)):  # weight, bias
        full = awkward(shape[0] * (shape[1] if len(shape) > 1 else 1), torch.float32, seed=heads).reshape(shape)
        # TP shards hold whole query groups: gathered along dim 0 they are the full tensor.
        gathered = torch.cat(torch.chunk(full, tp, dim=0))
        q, k, v = (torch.empty((n * d, *shape[1:]), dtype=dst_dtype) for n in (heads, kv, kv))
        ops.split_qkv(gathered, kv, q, k, v)
        rq, rk, rv = (torch.empty_like(t) for t in (q, k, v))
        native.split_qkv_reference(gathered, kv, rq, rk, rv)
        for a, b, hf in zip((q, k, v), (rq, rk, rv), qkv_from_megatron(full, cfg)):
            assert_bits_equal(a, b)
            assert_bits_equal(a, hf.to(dst_dtype))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.float16])
def test_split_gate_up_joins_tp_shards_like_the_adapter(ops, tp, dst_dtype):
    ffn, hidden = 32, 20
    shards = [awkward(2 * ffn // tp * hidden, torch.float32, seed=r).reshape(2 * ffn // tp, hidden) for r in range(tp)]
    gathered = torch.cat(shards)  # what an all-gather along dim 0 holds
    gate, up = torch.empty((ffn, hidden), dtype=dst_dtype), torch.empty((ffn, hidden), dtype=dst_dtype)
    ops.split_gate_up(gathered, tp, gate, up)
    rg, ru = torch.empty_like(gate), torch.empty_like(up)
    native.split_gate_up_reference(gathered, tp, rg, ru)
    hf_gate, hf_up = torch.chunk(join_tp_shards("decoder.layers.0.mlp.linear_fc1.weight", shards), 2, dim=0)
    for a, b, c in ((gate, rg, hf_gate), (up, ru, hf_up)):
        assert_bits_equal(a, b)
        assert_bits_equal(a, c.to(dst_dtype))


def test_bad_shapes_and_dtypes_are_named(ops):
    with pytest.raises(RuntimeError, match="bucket only 3"):
        ops.pack([torch.zeros(4)], torch.zeros(3))
    with pytest.raises(RuntimeError, match="int64 is not one of|Long is not one of"):
        ops.pack([torch.zeros(4, dtype=torch.int64)], torch.zeros(4))
    with pytest.raises(ValueError, match="split_qkv: qkv"):
        native.split_qkv(torch.zeros(10, 2), 2, torch.zeros(4, 2), torch.zeros(2, 2), torch.zeros(2, 2))


def test_cpu_library_links_openmp(ops):
    lib = native.build_dir() / "cpu" / "megarl_native.so"
    assert "libgomp" in subprocess.run(["ldd", str(lib)], capture_output=True, text=True).stdout


def test_public_ops_fall_back_to_the_reference_when_off(monkeypatch):
    monkeypatch.setenv("MEGARL_NATIVE", "off")
    native.cpu_ops.cache_clear()
    try:
        assert native.backend("cpu") == "reference"
        bucket = torch.empty(6, dtype=torch.bfloat16)
        native.pack([torch.arange(2.0), torch.ones(2, 2)], bucket)
        assert bucket.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    finally:
        native.cpu_ops.cache_clear()
    monkeypatch.setenv("MEGARL_NATIVE", "sometimes")
    with pytest.raises(ValueError, match="MEGARL_NATIVE='sometimes'"):
        native.mode()


def test_auto_mode_uses_a_prebuilt_library_and_never_compiles(ops, monkeypatch, tmp_path):
    monkeypatch.setenv("MEGARL_NATIVE", "auto")
    native.cpu_ops.cache_clear()
    try:
        assert native.backend("cpu") == "native"  # the fixture's build, found where `make kernels` puts it
        native.cpu_ops.cache_clear()
        monkeypatch.setenv("MEGARL_NATIVE_DIR", str(tmp_path / "empty"))
        assert native.backend("cpu") == "reference" and not (tmp_path / "empty").exists()  # nothing built
    finally:
        native.cpu_ops.cache_clear()


needs_nvcc = pytest.mark.skipif(native.nvcc() is None, reason="no nvcc on this machine (CUDA toolkit absent)")


@needs_nvcc
def test_cuda_kernels_compile_for_sm80_and_sm90():
    proc = subprocess.run(native.nvcc_command("/dev/null", shared=False), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@needs_nvcc
def test_cuda_launchers_load_and_report_errors_instead_of_crashing():
    lib = ctypes.CDLL(str(native.build_cuda()))
    lib.megarl_split_gate_up.argtypes = [ctypes.c_void_p, ctypes.c_int] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p]
    assert lib.megarl_split_gate_up(None, 9, None, 0, None, 0, 1, 4, None) != 0  # bad dtype kind: refused
    if not torch.cuda.is_available():  # no driver here: the launch returns a CUDA error, not a crash
        assert lib.megarl_split_gate_up(None, 0, None, 0, None, 0, 1, 4, None) != 0


@pytest.mark.gpu
def test_cuda_kernels_equal_the_reference_bit_for_bit(monkeypatch):
    monkeypatch.setenv("MEGARL_NATIVE", "jit")
    native.cuda_lib.cache_clear()
    assert native.backend("cuda") == "native"
    for src_dtype in DTYPES:
        for dst_dtype in DTYPES:
            srcs = [awkward(n, src_dtype, seed=n).cuda() for n in (5, 70_000, 0, 1 << 20)]
            got = torch.empty(sum(t.numel() for t in srcs), dtype=dst_dtype, device="cuda")
            ref = torch.empty_like(got)
            native.pack(srcs, got)
            native.pack_reference(srcs, ref)
            assert_bits_equal(got.cpu(), ref.cpu())
            outs = [torch.empty_like(t) for t in srcs]
            native.unpack(got, outs)
            refs = [torch.empty_like(t) for t in srcs]
            native.unpack_reference(ref, refs)
            for a, b in zip(outs, refs):
                assert_bits_equal(a.cpu(), b.cpu())
    heads, kv, d, hidden = 8, 2, 16, 64
    qkv = awkward(kv * (heads // kv + 2) * d * hidden, torch.float32, seed=1).reshape(-1, hidden).cuda()
    outs = [torch.empty((n * d, hidden), dtype=torch.bfloat16, device="cuda") for n in (heads, kv, kv)]
    refs = [torch.empty_like(t) for t in outs]
    native.split_qkv(qkv, kv, *outs)
    native.split_qkv_reference(qkv, kv, *refs)
    fc1 = awkward(2 * 96 * hidden, torch.float32, seed=2).reshape(-1, hidden).cuda()
    gu = [torch.empty((96, hidden), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    gu_ref = [torch.empty_like(t) for t in gu]
    native.split_gate_up(fc1, 4, *gu)
    native.split_gate_up_reference(fc1, 4, *gu_ref)
    torch.cuda.synchronize()
    for a, b in zip(outs + gu, refs + gu_ref):
        assert_bits_equal(a.cpu(), b.cpu())
    native.cuda_lib.cache_clear()
