"""GPU presets for ``megarl plan --gpu``: the figures the step-time model divides by.

Datasheet figures (dense, no sparsity) of the SXM parts in 8-GPU nodes: peak bf16 and FP8 tensor FLOP/s, HBM
size (as ``nvidia-smi`` reports it, in GiB) and bandwidth, NVLink bandwidth per GPU and direction, the network per
GPU (one 400 Gb/s NIC per H100/H200/B200, 200 Gb/s per A100: the DGX reference designs) and the host link (PCIe,
one direction, what sleep level 1 and the trainer's offload move weights over). Any of them can be given as a
flag instead (``--peak-tflops`` …), for other parts or measured figures.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from megarl.config import ConfigError


@dataclass(frozen=True)
class Gpu:
    name: str
    peak_tflops: float
    """Dense bf16 tensor TFLOP/s."""
    fp8_tflops: float
    """Dense FP8 tensor TFLOP/s (``model.fp8``); 0: none (A100: bf16's)."""
    mem_gib: float
    hbm_tbps: float
    """HBM bandwidth, TB/s."""
    nvlink_gbps: float
    """NVLink bandwidth per GPU, one direction, GB/s."""
    network_gbps: float
    """Network bandwidth per GPU across nodes, GB/s."""
    host_gbps: float
    """Host link (PCIe) per GPU, one direction, GB/s."""


PRESETS = {
    "a100": Gpu("a100", 312.0, 0.0, 80.0, 2.04, 300.0, 25.0, 25.0),
    "h100": Gpu("h100", 989.0, 1979.0, 79.6, 3.35, 450.0, 50.0, 55.0),
    "h200": Gpu("h200", 989.0, 1979.0, 140.4, 4.8, 450.0, 50.0, 55.0),
    "b200": Gpu("b200", 2250.0, 4500.0, 179.0, 8.0, 900.0, 50.0, 55.0),
}
FLAGS = ("peak_tflops", "fp8_tflops", "hbm_tbps", "nvlink_gbps", "network_gbps", "host_gbps")
"""The figures a flag of the same name (``--peak-tflops`` …) sets instead of the preset's."""


def gpu_of(name: str, **given: float | None) -> Gpu:
    """The preset ``name`` with the figures given (not None) in its place; ConfigError names a bad one."""
    if name not in PRESETS:
        raise ConfigError(f"--gpu {name}: not a preset; valid: {', '.join(PRESETS)} (or give --peak-tflops, "
                          "--hbm-tbps, --nvlink-gbps, --network-gbps for another part)")
    known = {f.name for f in fields(Gpu)}
    for key, value in given.items():
        if key not in known:
            raise ConfigError(f"unknown GPU figure {key!r}; valid: {', '.join(FLAGS)}")
        if value is not None and not value > 0 and not (key == "fp8_tflops" and value == 0):
            raise ConfigError(f"--{key.replace('_', '-')} must be > 0, got {value:g}")
    return replace(PRESETS[name], **{k: v for k, v in given.items() if v is not None})


def describe(gpu: Gpu) -> str:
    """'h100: 989 TFLOP/s bf16, 3.35 TB/s HBM, NVLink 450 GB/s, network 50 GB/s, host 55 GB/s'."""
    return (f"{gpu.name}: {gpu.peak_tflops:g} TFLOP/s bf16, {gpu.hbm_tbps:g} TB/s HBM, NVLink {gpu.nvlink_gbps:g} "
            f"GB/s, network {gpu.network_gbps:g} GB/s, host {gpu.host_gbps:g} GB/s")
