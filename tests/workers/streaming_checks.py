"""Streaming, resharded weight sync on real parts: a megatron-core trainer (gloo) → a colocated vLLM engine.

    torchrun --nproc-per-node 2 tests/workers/streaming_checks.py engine MODEL_DIR tp2_sp,pp2,ep2_alltoall
    python tests/workers/streaming_checks.py memory MODEL_DIR BUCKET_MIB

``engine``: one vLLM engine (TP = world) is built once; then, for each layout in turn, a fresh
trainer takes optimizer steps (as many as the layout's position: the engine is always stale), and the script records on
every rank: whether the streamed HF tensors equal ``gather_hf_weights`` exactly, the engine-vs-trainer logprob gap
before the sync (stale weights) and after it, and the sync's stats. Rank 0 prints one JSON line.

``memory`` (one process, no engine): the peak RSS added by a streamed sync whose tensors are
consumed and dropped (through buckets, and zero-copy: the one-process path of the colocated
engine's load), next to the same for ``gather_hf_weights`` and the model's size. Run it
with ``MALLOC_MMAP_THRESHOLD_=65536``: every large buffer is then its own mapping, so RSS rises
when it is touched and falls when it is freed (glibc's default keeps freed memory in the heap,
which hides new allocations from the peak).
"""

from __future__ import annotations

import json
import os
import re
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers


def sample_batch(engine, vocab: int, seed: int):
    from megarl.algo.batch import build_batch
    from megarl.types import GenerationRequest

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, vocab, (6,), generator=g).tolist() for _ in range(4)]
    outs = engine.generate([GenerationRequest(p, n=2, max_tokens=12, temperature=1.0) for p in prompts], seed=seed)
    P = [p for p, cs in zip(prompts, outs) for _ in cs]
    R = [c.token_ids for cs in outs for c in cs]
    L = [c.logprobs for cs in outs for c in cs]
    return build_batch(P, R, L)


def gap(engine, trainer, vocab: int, seed: int) -> float:
    batch = sample_batch(engine, vocab, seed)
    return float(((trainer.logprobs(batch) - batch.old_logprobs) * batch.loss_mask).abs().max())


def engine_checks(model_dir: str, layouts: str) -> None:
    from megarl.distributed.parallel import init_process_group
    from megarl.engines.vllm_engine import VLLMEngine, set_cpu_engine_env

    set_cpu_engine_env(1.0)
    import vllm  # noqa: F401  (before the CPU adapter patches torch.cuda)

    rank, world = init_process_group()
    engine = VLLMEngine(model_dir, max_model_len=64, tensor_parallel_size=world, seed=0, max_num_seqs=16)

    from megatron.core import parallel_state as mpu

    from helpers.trainers import build_trainer, fixed_batch
    from megarl.algo.losses import ppo_clip_loss
    from megarl.config.schema import OptimConfig
    from megarl.models.hf_config import num_experts
    from megarl.weight_sync.gather import gather_hf_weights
    from megarl.weight_sync.streaming import StreamingSync

    results = {}
    for i, layout in enumerate(layouts.split(",")):
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        ps, cfg, trainer = build_trainer(layout, model_dir, OptimConfig(lr=3e-3, micro_batch_size=4, grad_clip=1.0))
        batch = fixed_batch(cfg["vocab_size"])
        for _ in range(i + 1):  # a different number of steps per layout: the engine's weights are stale
            trainer.train_step(batch, lambda lp, mb: ppo_clip_loss(lp, mb["old_logprobs"], mb["advantages"],
                                                                   mb["loss_mask"], 0.2, 0.28))
        sync = StreamingSync(trainer.modules, cfg, ps, num_experts(cfg), bucket_bytes=1 << 16)
        streamed = [(n, t.clone()) for n, t in sync.weights()]
        full = dict(gather_hf_weights(trainer.modules, cfg, ps, num_experts(cfg)))
        same = sorted(n for n, _ in streamed) == sorted(full)
        diff = max(float((t - full[n]).abs().max()) for n, t in streamed)
        del full, streamed
        stale = gap(engine, trainer, cfg["vocab_size"], seed=10 + i)
        engine.update_weights(sync.weights())
        after = gap(engine, trainer, cfg["vocab_size"], seed=20 + i)
        r = {"same_names": same, "max_diff": diff, "gap_stale": stale, "gap_after": after,
             "buckets": sync.stats.buckets, "bytes": sync.stats.bytes, "peak_extra": sync.stats.peak_extra_bytes,
             "tp": ps.tp, "pp": ps.pp, "ep": ps.ep}
        every = [None] * world
        dist.all_gather_object(every, r)
        results[layout] = every
    if rank == 0:
        print(json.dumps({"layouts": results}), flush=True)
    dist.barrier()


def _status(key: str) -> int:
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def peak_rss_added(fn) -> int:
    """Peak RSS while ``fn`` runs, above the RSS before it (Linux: clear_refs 5 resets the peak)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def memory_checks(model_dir: str, bucket_mib: str) -> None:
    from megarl.distributed.parallel import build_parallel_state
    from megarl.models.hf_config import num_experts
    from megarl.weight_sync.gather import gather_hf_weights
    from megarl.weight_sync.streaming import StreamingSync

    ps = build_parallel_state()
    from megarl.compat.megatron import activate_cpu

    activate_cpu()
    from megarl.models.hf_config import read_hf_config
    from megarl.trainer.model import build_gpt_model, load_hf_weights

    cfg = read_hf_config(model_dir)
    modules = [build_gpt_model(cfg, ps, 0)]
    load_hf_weights(modules, model_dir, cfg, ps)
    model_bytes = sum(p.numel() * p.element_size() for p in modules[0].parameters())
    largest = max(p.numel() * p.element_size() for p in modules[0].parameters())
    sync = StreamingSync(modules, cfg, ps, num_experts(cfg), bucket_bytes=int(float(bucket_mib) * 2**20))
    sync.plan()

    def drain(it):
        n = 0
        for _, t in it:
            n += t.numel()
        return n

    streamed = peak_rss_added(lambda: drain(sync.weights()))
    tracked = sync.stats.peak_extra_bytes
    zero = peak_rss_added(lambda: drain(sync.weights(zero_copy=True)))
    zero_tracked = sync.stats.peak_extra_bytes
    # zero-copy hands over the trainer's own tensors where it can: the same names, values and order
    same = all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(sync.weights(), sync.weights(zero_copy=True),
                                                                       strict=True))
    gathered = peak_rss_added(lambda: drain(gather_hf_weights(modules, cfg, ps, num_experts(cfg))))
    print(json.dumps({"model_bytes": model_bytes, "largest_tensor": largest, "layers": cfg["num_hidden_layers"],
                      "stream_peak": streamed, "gather_peak": gathered, "tracked_peak": tracked,
                      "zero_copy_peak": zero, "zero_copy_tracked": zero_tracked, "zero_copy_same": same,
                      "bucket_bytes": sync.bucket_bytes, "buckets": sync.stats.buckets}), flush=True)


if __name__ == "__main__":
    what, *args = sys.argv[1:]
    {"engine": engine_checks, "memory": memory_checks}[what](*args)
    from helpers.processes import end_process_group  # (tests/ is on the worker's path)
    end_process_group()  # gloo ended before the interpreter's teardown
