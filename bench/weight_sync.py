"""Weight sync, side by side in one run; one line per figure.

    python bench/weight_sync.py [--layers 16] [--hidden 512] [--bucket-mib 16] [--repeats 3]

1. pack: the csrc/ pack kernel (fp32 tensors → one bf16 bucket) vs ``torch.cat`` of the same
   tensors cast to bf16 (the kernel is JIT-built and cached on first use);
2. sync: streaming in-memory sync of a trainer's weights into a vLLM CPU engine (megatron-core
   model → HF buckets → ``reload_weights``) vs saving the same weights to disk as safetensors and
   loading the engine from those files;
3. move: the same two paths without the engine's own load (vLLM's reload dominates the sync);
4. memory: the peak extra memory of a streamed sync (RSS, with every large buffer its own
   mapping) as a fraction of the model's size.
5. disagg: a sync into ``--replicas`` vLLM engines in processes of their own (vLLM's weight-transfer
   API, our gloo backend, each bucket broadcast once to all; including the replicas' load) vs a
   plain gloo broadcast of the same buckets to the same processes, received and dropped.

``--only disagg`` runs the last line alone.

The model is a tiny Qwen2 of the given depth and width made here (no download); figures are
medians of ``--repeats`` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# glibc keeps freed memory in its heap by default, which hides new buffers from the RSS peak.
if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})

import torch  # noqa: E402


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_pack(tensors: list[torch.Tensor], repeats: int) -> None:
    from megarl import native

    native.build_cpu()
    ops = torch.ops.megarl_native
    total = sum(t.numel() for t in tensors)
    bucket = torch.empty(total, dtype=torch.bfloat16)
    kernel = median_time(lambda: ops.pack(tensors, bucket), repeats)
    cat = median_time(lambda: torch.cat([t.reshape(-1).to(torch.bfloat16) for t in tensors]), repeats)
    mb = total * 4 / 1e6
    print(f"pack   {mb:.0f} MB fp32 -> bf16, {len(tensors)} tensors, {torch.get_num_threads()} threads: "
          f"kernel {kernel * 1e3:.1f} ms vs torch.cat {cat * 1e3:.1f} ms = {cat / kernel:.1f}x faster", flush=True)


def _rss(key: str) -> int:
    import re

    return int(re.search(key + r":\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--bucket-mib", type=float, default=16.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--only", choices=["all", "disagg"], default="all")
    args = ap.parse_args()

    from megarl.engines.vllm_engine import VLLMEngine, set_cpu_engine_env
    from megarl.models.tiny import TinyShape, make_tiny_model

    set_cpu_engine_env(1.0)
    import vllm  # noqa: F401  (before the CPU adapter patches torch.cuda)

    work = Path(tempfile.mkdtemp(prefix="megarl-bench-sync-"))
    h = args.hidden
    shape = TinyShape(family="qwen2", hidden_size=h, intermediate_size=3 * h, num_heads=8, num_kv_heads=2,
                      head_dim=h // 8, num_layers=args.layers)
    model_dir = make_tiny_model(work / "model", shape, seed=0)

    from megarl.models.hf_config import num_experts, read_hf_config
    from megarl.trainer import cpu_adapter
    from megarl.trainer.parallel import build_parallel_state

    ps = build_parallel_state()
    if args.only == "disagg":
        cpu_adapter.activate()
        bench_disaggregated(model_dir, ps, args)
        return
    engine = VLLMEngine(str(model_dir), max_model_len=64, seed=0, max_num_seqs=4)
    cpu_adapter.activate()
    from safetensors.torch import load_file

    from megarl.trainer.model import build_gpt_model, load_hf_weights
    from megarl.weight_sync.export import gather_hf_weights
    from megarl.weight_sync.hf_adapter import save_hf_checkpoint
    from megarl.weight_sync.streaming import StreamingSync

    cfg = read_hf_config(model_dir)
    modules = [build_gpt_model(cfg, ps, 0)]
    load_hf_weights(modules, str(model_dir), cfg, ps)
    params = [p.detach() for p in modules[0].parameters()]
    model_bytes = sum(p.numel() * p.element_size() for p in params)

    bench_pack(params, args.repeats)

    sync = StreamingSync(modules, cfg, ps, num_experts(cfg), int(args.bucket_mib * 2**20), torch.float32)
    stream_s = median_time(lambda: engine.update_weights(sync.weights()), args.repeats)

    def via_disk():
        out = work / "synced"
        save_hf_checkpoint(str(out), gather_hf_weights(modules, cfg, ps, num_experts(cfg)), str(model_dir))
        os.sync()
        engine.update_weights(load_file(str(out / "model.safetensors")).items())

    disk_s = median_time(via_disk, args.repeats)
    print(f"sync   {model_bytes / 1e6:.0f} MB fp32 model, {args.layers} layers, vLLM CPU engine: streaming in memory "
          f"{stream_s:.3f} s ({sync.stats.buckets} buckets of {args.bucket_mib:g} MiB) vs save to disk + reload "
          f"{disk_s:.3f} s = {disk_s / stream_s:.1f}x faster", flush=True)

    def drain():
        for _ in sync.weights():
            pass

    def disk_round_trip():  # the same bytes through safetensors files, without the engine's load
        out = work / "transport"
        save_hf_checkpoint(str(out), gather_hf_weights(modules, cfg, ps, num_experts(cfg)), str(model_dir))
        os.sync()
        for _ in load_file(str(out / "model.safetensors")).items():
            pass

    drain_s, files_s = median_time(drain, args.repeats), median_time(disk_round_trip, args.repeats)
    print(f"move   the same weights without the engine's load: streamed buckets {drain_s:.3f} s vs safetensors "
          f"save + load {files_s:.3f} s = {files_s / drain_s:.1f}x faster", flush=True)

    def peak_added(fn) -> int:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux)
        before = _rss("VmRSS")
        fn()
        return _rss("VmHWM") - before

    peak = peak_added(drain)
    print(f"memory peak extra RSS of a streamed sync: {peak / 2**20:.1f} MiB = {peak / model_bytes:.3f} of the "
          f"{model_bytes / 2**20:.0f} MiB model (tracked buffers {sync.stats.peak_extra_bytes / 2**20:.1f} MiB; "
          f"bucket {args.bucket_mib:g} MiB)", flush=True)
    into_engine = peak_added(lambda: engine.update_weights(sync.weights()))
    gathered = peak_added(lambda: engine.update_weights(gather_hf_weights(modules, cfg, ps, num_experts(cfg))))
    print(f"memory with the engine loading: streamed {into_engine / 2**20:.1f} MiB = {into_engine / model_bytes:.3f} "
          f"of the model vs full gather {gathered / 2**20:.1f} MiB = {gathered / model_bytes:.3f}", flush=True)
    bench_disaggregated(model_dir, ps, args)


def bench_disaggregated(model_dir, ps, args) -> None:
    from megarl.engines.replicas import EngineReplicas, flat_buckets, plan_buckets
    from megarl.models.hf_config import num_experts, read_hf_config
    from megarl.trainer.model import build_gpt_model, load_hf_weights
    from megarl.weight_sync.streaming import StreamingSync

    cfg = read_hf_config(model_dir)
    modules = [build_gpt_model(cfg, ps, 0)]
    load_hf_weights(modules, str(model_dir), cfg, ps)
    sync = StreamingSync(modules, cfg, ps, num_experts(cfg), int(args.bucket_mib * 2**20), torch.float32)
    plan = plan_buckets(sync)
    # the replicas' malloc as glibc's default settles (heap up to 32 MiB), as in a run: the RSS line's
    # setting (every buffer > 64 KiB a fresh mapping) would make vLLM's reload page-fault on every sync.
    # (Set, not unset: a spawned replica re-imports this script, which re-executes itself without it.)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(32 << 20)
    replicas = EngineReplicas(str(model_dir), args.replicas, 1, 64, 0.0625, 4)
    try:
        version, updates = iter(range(1, 1000)), []

        def synced_once():
            updates.append(replicas.load(plan, flat_buckets(sync, plan), next(version))["sync/replica_update_s"])

        buckets = [b.clone() for b in flat_buckets(sync, plan)]
        synced, plain = [], []
        synced_once(), replicas.broadcast_raw(buckets)  # warm-up
        for _ in range(args.repeats):  # interleaved, so both see the same neighbours
            synced.append(_timed(synced_once))
            plain.append(_timed(lambda: replicas.broadcast_raw(buckets)))
        fill = median_time(lambda: sum(1 for _ in flat_buckets(sync, plan)), args.repeats)
    finally:
        replicas.close()
    nbytes = sum(b.nbytes for b in buckets)
    synced_s, plain_s = statistics.median(synced), statistics.median(plain)
    print(f"disagg {nbytes / 1e6:.0f} MB to {args.replicas} engine processes ({len(buckets)} buckets of "
          f"{args.bucket_mib:g} MiB): bucketed sync through vLLM's weight-transfer API (gloo, incl. the replicas' "
          f"load) {synced_s:.3f} s vs plain gloo broadcast of the same bytes {plain_s:.3f} s = "
          f"{plain_s / synced_s:.2f} of the plain broadcast's speed (runs: {_runs(plain, synced)}; trainer fills "
          f"the buckets in {fill:.3f} s, a replica's start→finish {statistics.median(updates[1:]):.3f} s)",
          flush=True)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _runs(plain: list[float], synced: list[float]) -> str:
    return ", ".join(f"{p / s:.2f}" for p, s in zip(plain, synced))


if __name__ == "__main__":
    main()
