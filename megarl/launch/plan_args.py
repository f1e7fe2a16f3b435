"""``megarl plan``'s flags: the job, the GPU's figures (a preset or each given), the step's lengths and the step-time
model's assumptions; bad values are refused naming the flag and what would be valid."""

from __future__ import annotations

import argparse

from megarl.config import ConfigError
from megarl.config.schema import RunConfig
from megarl.launch.gpus import FLAGS, PRESETS, Gpu, gpu_of
from megarl.launch.memory import WEIGHT_BYTES
from megarl.launch.step_time import MFU, Work, work_of

GPU_FLAG_HELP = {
    "peak_tflops": "dense bf16 TFLOP/s per GPU",
    "fp8_tflops": "dense FP8 TFLOP/s per GPU (with model.fp8)",
    "hbm_tbps": "HBM bandwidth per GPU, TB/s (decode and the optimizer read at it)",
    "nvlink_gbps": "NVLink bandwidth per GPU and direction, GB/s (TP, EP and DP within a node, colocated sync)",
    "network_gbps": "network bandwidth per GPU across nodes, GB/s (DP, EP and engines across nodes, "
                    "disaggregated sync)",
    "host_gbps": "host link per GPU, GB/s (engine.sleep_level=1, trainer.offload_during_rollout)",
}


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megarl plan", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint directory or config.json (default: the config's model.path)")
    ap.add_argument("--nodes", type=int, default=1, help="the job's nodes (engine-only nodes included)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--trainer-gpus-per-node", type=int, default=0, help="the trainer's processes per node, on "
                    "GPUs 0..N-1 (TRAINER_GPUS_PER_NODE of the launch scripts; default: --gpus-per-node less the GPUs "
                    "engine.replica_devices takes on the trainer's nodes); fewer than --gpus-per-node: the other GPUs "
                    "run replicas, and only such layouts are proposed")
    ap.add_argument("--gpu", default="h100", help=f"GPU preset: {', '.join(PRESETS)} (default h100): its peak "
                    "FLOP/s, HBM size and bandwidth, NVLink, network and host bandwidth; a flag below replaces one")
    for name in FLAGS:
        ap.add_argument(f"--{name.replace('_', '-')}", type=float, default=None, help=GPU_FLAG_HELP[name])
    ap.add_argument("--gpu-mem-gib", type=float, default=None,
                    help="memory per GPU in GiB (default: the preset's, 79.6 for h100; with --cpu 80)")
    ap.add_argument("--mfu", type=float, default=None, help=f"training's model FLOP utilisation, 0 < MFU <= 1 "
                    f"(default {MFU['dense']} dense, {MFU['moe']} MoE); prefill runs at it too")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="mean prompt length (default: half of "
                    "engine.max_model_len - rollout.max_new_tokens)")
    ap.add_argument("--response-tokens", type=int, default=None,
                    help="mean response length (default: half of rollout.max_new_tokens)")
    ap.add_argument("--bubble", type=float, default=None, help="the rollout's idle share, 0 <= bubble < 1, e.g. "
                    "tools/simulate_rollout.py's bubble_ratio (default: sync mode's tail, rollout.max_new_tokens - "
                    "the mean response; on_policy and partial: their measured bubble)")
    ap.add_argument("--precision", choices=sorted(WEIGHT_BYTES), default=None,
                    help="the trainer's precision to size (default: the config's trainer.precision): bf16 is "
                    "megatron's mixed precision, fp32 everything in fp32; engines follow unless engine.dtype says")
    ap.add_argument("--cpu", action="store_true", help="size CPU processes (the tiny runs): --gpus-per-node is then "
                    "processes per node and --gpu-mem-gib the memory of each; no CUDA runtime overhead, no step "
                    "time: the first layout that fits is proposed")
    ap.add_argument("--config", help="YAML config file")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    ap.add_argument("overrides", nargs="*", help="KEY.PATH=VALUE overrides, as for megarl train")
    return ap


def work_and_gpu(args, cfg: RunConfig, hf: dict) -> tuple[Work | None, Gpu | None, float]:
    """The step's work, the GPU's figures and the memory per GPU from the flags (None, None with ``--cpu``);
    ConfigError names a bad flag and what would be valid."""
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ConfigError(f"--nodes ({args.nodes}) and --gpus-per-node ({args.gpus_per_node}) must be >= 1")
    if not 0 <= args.trainer_gpus_per_node <= args.gpus_per_node:
        raise ConfigError(f"--trainer-gpus-per-node {args.trainer_gpus_per_node}: valid 1..{args.gpus_per_node} "
                          "(--gpus-per-node; the rest of each node runs replicas)")
    if args.gpu_mem_gib is not None and not args.gpu_mem_gib > 0:
        raise ConfigError(f"--gpu-mem-gib must be > 0, got {args.gpu_mem_gib:g}")
    if args.cpu:
        return None, None, 80.0 if args.gpu_mem_gib is None else args.gpu_mem_gib
    gpu = gpu_of(args.gpu, **{name: getattr(args, name) for name in FLAGS})
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu must be in (0, 1], got {args.mfu:g} (a share of the peak: 0.4 is 40%)")
    if args.bubble is not None and not 0 <= args.bubble < 1:
        raise ConfigError(f"--bubble must be in [0, 1), got {args.bubble:g} (the rollout's idle share)")
    r, e = cfg.rollout, cfg.engine
    if args.response_tokens is not None and not 1 <= args.response_tokens <= r.max_new_tokens:
        raise ConfigError(f"--response-tokens {args.response_tokens}: valid 1 .. rollout.max_new_tokens="
                          f"{r.max_new_tokens} (the mean response, at most the cap)")
    budget = e.max_model_len - (args.response_tokens or r.max_new_tokens // 2)
    if args.prompt_tokens is not None and not 1 <= args.prompt_tokens <= budget:
        raise ConfigError(f"--prompt-tokens {args.prompt_tokens}: valid 1 .. {budget} (engine.max_model_len="
                          f"{e.max_model_len} less the mean response)")
    work = work_of(cfg, hf, args.prompt_tokens or 0, args.response_tokens or 0, args.mfu or 0.0, args.bubble)
    return work, gpu, gpu.mem_gib if args.gpu_mem_gib is None else args.gpu_mem_gib
