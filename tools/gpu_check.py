#!/usr/bin/env python
"""The trainer and the CUDA kernels on one GPU, without vLLM: what ``tools/gpu_check.sh`` runs (bench/README.md,
"GPU check").

    python tools/gpu_check.py OUT_DIR [--steps 6] [--parts kernels,collectives,tiny,big]

Parts, in this order; each after the setup runs in a process of its own (megatron-core keeps process-global state),
and OUT_DIR/figures.json is rewritten as each ends:

- setup: Python, torch and its CUDA, the GPU, nvcc, the packages the parts need, and what is left out (vLLM:
  every engine test; Transformer Engine: FP8, TE's context parallelism, LoRA on TE's layers). Without CUDA it
  stops there (exit 3);
- kernels: csrc/'s CUDA kernels built with nvcc and compared bit for bit with their torch references, run as
  ``pytest -k cuda tests/unit/test_native.py`` (the ``gpu`` test among them);
- collectives: two processes on this GPU over the default group megarl starts with GPUs (gloo beside NCCL): the
  host-tensor collectives every step runs (``collectives.any_rank``), which a group of NCCL alone refuses, run as
  ``pytest -m gpu tests/gpu/test_host_collectives_gpu.py``;
- tiny: the trainer on the GPU in bf16 with packed micro-batches (``trainer.packing``), a tiny MoE (qwen3_moe) and a
  tiny dense model (qwen2), ``--steps`` optimizer steps of NLL on one fixed batch: every loss finite, the last
  below the first; and the tiny MoE with LoRA (attention and every expert, dropout from megatron's CUDA RNG
  tracker): the same, its base weights bit for bit unchanged and its adapters' B moved from zero;
- big: a 1B-class model (Llama-3.2-1B's shapes, random bf16 weights made here; nothing is downloaded), the same
  trainer: the seconds of an optimizer step on 16 packed sequences of 1024 tokens and its peak memory, beside
  ``megarl plan``'s estimate for the same shapes and batch (``plan_estimate``: its train seconds, its trainer
  memory), and their ratios.

Exit 0 when every part ran and passed, 1 when one failed or could not run (its entry says why), 3 without CUDA.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("kernels", "collectives", "tiny", "big")
NEEDS = {"kernels": ("pytest",), "collectives": ("pytest",), "tiny": ("megatron.core", "yaml", "safetensors"),
         "big": ("megatron.core", "yaml", "safetensors")}
"""The modules each part imports beyond torch (the wheels ``gpu_check.sh`` installs: megatron-core, pyyaml,
safetensors, pytest)."""
LEFT_OUT = {"vllm": "every engine test (tests/engine, tests/gpu/test_moe_engine_gpu.py, test_bf16_gpu.py, the "
                    "routing replay of colocated engines)",
            "transformer_engine": "FP8, Transformer Engine's context parallelism and LoRA on its layers "
                                  "(tests/gpu/test_fp8_gpu.py, test_context_parallel_gpu.py, test_lora_te_gpu.py)"}
"""What this check does not run, by the package it would need."""
TIMEOUT_S = {"kernels": 180, "collectives": 120, "tiny": 180, "big": 300}
"""Each part's limit (on an H100: about 10 minutes in all, the machine's start aside)."""
TORCH = "2.13"
"""The torch megarl pins (setup.py); another is said, and its figures are that torch's."""
NO_CUDA = 3

LLAMA_1B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
            "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "hidden_act": "silu", "tie_word_embeddings": True, "rope_theta": 500000.0, "attention_bias": False,
            "bos_token_id": 1, "eos_token_id": 1, "pad_token_id": 0, "torch_dtype": "bfloat16"}
"""meta-llama/Llama-3.2-1B's shapes (1.24B parameters; its llama3 rope scaling left out: it changes no shape)."""
BIG_BATCH = {"sequences": 16, "prompt": 256, "response": 768, "microbatch_tokens": 8192}
"""The 1B step's batch: packed into micro-batches of at most ``microbatch_tokens``."""


def setup() -> dict:
    """What this machine has for the check: versions, the GPU, nvcc, the parts' packages, what is left out."""
    import torch

    from megarl.weight_sync.native import nvcc

    modules = sorted({m for needs in NEEDS.values() for m in needs} | set(LEFT_OUT))
    have = {m: importlib.util.find_spec(m) is not None for m in modules}
    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cuda": cuda, "nvcc": nvcc(), "modules": have,
           "versions": {d: _version(d) for d in ("megatron-core", "pyyaml", "safetensors", "pytest", "vllm")},
           "left_out": {m: why for m, why in LEFT_OUT.items() if not have[m]}}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        out["gpu"] = {"name": props.name, "memory_gib": props.total_memory / 2**30,
                      "capability": f"{props.major}.{props.minor}", "count": torch.cuda.device_count()}
    return out


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def kernels(out_dir: Path) -> dict:
    """``pytest -k cuda tests/unit/test_native.py``: compile for sm80/sm90, the launchers' errors, and the gpu test
    (every kernel against its reference, bit for bit); the build cached under OUT_DIR."""
    return _pytest(["-k", "cuda", "tests/unit/test_native.py"], "3 passed",
                   {"MEGARL_NATIVE_DIR": str(out_dir / "native")})


def collectives(out_dir: Path) -> dict:
    """``pytest -m gpu tests/gpu/test_host_collectives_gpu.py`` (two processes by torchrun on this GPU)."""
    return _pytest(["-m", "gpu", "tests/gpu/test_host_collectives_gpu.py"], "1 passed")


def _pytest(args: list[str], passed: str, env: dict | None = None) -> dict:
    """``pytest -q args`` in ROOT: ok when it exits 0 with ``passed`` in its summary and nothing skipped."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": _pythonpath()}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1] if lines else proc.stderr.strip()[-500:]
    return {"ok": proc.returncode == 0 and "skipped" not in summary and passed in summary,
            "summary": summary, "seconds": time.perf_counter() - start,
            **({"output": proc.stdout[-3000:] + proc.stderr[-2000:]} if proc.returncode else {})}


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")) if p)


def write_model(path: Path, cfg: dict, std: float = 0.02, seed: int = 0) -> Path:
    """config.json and model.safetensors of ``cfg`` with N(0, std) matrices, ones for norms, zeros for biases,
    made on the GPU in the config's dtype (a tied model has no lm_head). No tokenizer: the trainer reads none."""
    import torch
    from safetensors.torch import save_file

    from megarl.models.tiny import hf_weight_shapes

    dtype = getattr(torch, cfg.get("torch_dtype", "float32"))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (CPU: the parts' own tests)
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in sorted(hf_weight_shapes(cfg).items()):
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if name.endswith("norm.weight") or "layernorm" in name:
            t = torch.ones(shape, dtype=dtype)
        elif name.endswith(".bias"):
            t = torch.zeros(shape, dtype=dtype)
        else:
            t = (torch.randn(shape, generator=gen, device=device) * std).to(dtype).cpu()
        weights[name] = t
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def packed_trainer(model_dir: Path, microbatch_tokens: int, lr: float, lora=None, **frozen):
    """megarl's policy trainer of ``model_dir`` on this GPU: bf16 (fp32 main weights and Adam), packed micro-batches
    of at most ``microbatch_tokens``, one process (TP = PP = DP = 1), LoRA adapters with ``lora`` (a LoraConfig);
    ``frozen``: ``trainable=False`` and ``on_host`` (a KL reference). (Without CUDA: megarl's CPU adapter.)"""
    from megatron.core import tensor_parallel

    from megarl.compat.megatron import activate_cpu
    from megarl.config.schema import OptimConfig
    from megarl.distributed.parallel import build_parallel_state
    from megarl.models.hf_config import read_hf_config
    from megarl.trainer.policy import PolicyTrainer

    ps = build_parallel_state()
    activate_cpu()  # (nothing where CUDA is)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    optim = OptimConfig(lr=lr, micro_batch_size=1024)
    return PolicyTrainer(read_hf_config(str(model_dir)), str(model_dir), ps, optim, precision="bf16", packing=True,
                         max_tokens_per_microbatch=microbatch_tokens, lora=lora, **frozen)


def random_batch(vocab: int, rows: int, prompt: int, response: int, seed: int, vary: bool = True):
    """``rows`` random sequences (responses of varied lengths unless ``vary`` is off) as a ``TrainBatch``."""
    import torch

    from megarl.algo.batch import build_batch

    g = torch.Generator().manual_seed(seed)
    lengths = [max(1, response - (i * 7) % max(1, response // 2)) if vary else response for i in range(rows)]
    prompts = [torch.randint(2, vocab, (prompt,), generator=g).tolist() for _ in range(rows)]
    responses = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]
    return build_batch(prompts, responses)


def nll(logp, mb):
    from megarl.algo.losses import nll_loss

    return nll_loss(logp, mb["loss_mask"])


def tiny(steps: int, work: Path) -> dict:
    """A tiny MoE and a tiny dense model, each trained ``steps`` steps on one fixed packed batch."""
    import torch

    out = {}
    for family in ("qwen3_moe", "qwen2"):
        trainer, batch = tiny_trainer(work, family, family)
        out[family] = {**fit(trainer, batch, steps), "params_dtype": str(trainer.dtype)}
        del trainer
        torch.cuda.empty_cache()
    out["qwen3_moe_lora"] = tiny_lora(steps, work)
    out["host_reference"] = tiny_host_reference(work)
    out["ok"] = all(out[f]["finite"] and out[f]["falling"] for f in ("qwen3_moe", "qwen2")) and \
        out["qwen3_moe_lora"]["ok"] and out["host_reference"]["ok"]
    return out


def tiny_host_reference(work: Path) -> dict:
    """``trainer.reference_on_host`` on the tiny MoE: after two policy steps, a reference kept in pinned host memory
    and copied into the policy's model for its forward scores the batch as a reference on the GPU does, and the
    policy's weights and logprobs come back bit for bit; the host copy holds no GPU memory."""
    import torch

    from megarl.trainer.rl_update import HostReference

    policy, batch = tiny_trainer(work, "qwen3_moe_reference", "qwen3_moe", lr=1e-2)
    fit(policy, batch, 2)
    model = work / "qwen3_moe_reference"
    resident = packed_trainer(model, 256, 1e-2, trainable=False)
    held = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    host = HostReference(policy, packed_trainer(model, 256, 1e-2, trainable=False, on_host=True))
    added = (torch.cuda.memory_allocated() if torch.cuda.is_available() else 0) - held
    weights = [p.detach().clone() for m in policy.modules for p in m.parameters()]
    before = policy.logprobs(batch)
    got, want = host.logprobs(batch), resident.logprobs(batch)
    mask = batch.loss_mask.bool()
    now = (p for m in policy.modules for p in m.parameters())
    out = {"reference_gap": float((got - want)[mask].abs().max()),
           "policy_gap": float((got - before)[mask].abs().max()),
           "weights_back": all(torch.equal(w, p) for w, p in zip(weights, now)),
           "logprobs_back": bool(torch.equal(before, policy.logprobs(batch))), "gpu_bytes_added": added}
    out["ok"] = out["reference_gap"] == 0 and out["policy_gap"] > 0 and out["weights_back"] and \
        out["logprobs_back"] and added < 1 << 20
    del policy, resident, host
    torch.cuda.empty_cache()
    return out


def tiny_lora(steps: int, work: Path) -> dict:
    """The tiny MoE with LoRA (rank 8 on attention and every expert, dropout 0.1), ``steps`` steps as ``tiny``'s: its
    losses, whether every base weight is bit for bit as loaded, and the adapters' largest B (zero at the start)."""
    import torch

    from megarl.config.schema import LoraConfig

    lora = LoraConfig(rank=8, alpha=16.0, dropout=0.1, targets="linear_qkv,linear_proj,experts")
    trainer, batch = tiny_trainer(work, "qwen3_moe_lora", "qwen3_moe", lr=1e-2, lora=lora)
    base = {n: p.detach().clone() for m in trainer.modules for n, p in m.named_parameters() if ".lora." not in n}
    out = fit(trainer, batch, steps)
    after = {n: p for m in trainer.modules for n, p in m.named_parameters()}
    frozen = all(torch.equal(after[n], p) for n, p in base.items())
    b_max = max(float(a.b.detach().abs().max()) for a in trainer.adapters)
    out.update(adapters=len(trainer.adapters), base_unchanged=frozen, b_max=b_max)
    out["ok"] = out["finite"] and out["falling"] and frozen and b_max > 0
    del trainer
    torch.cuda.empty_cache()
    return out


def tiny_trainer(work: Path, name: str, family: str, lr: float = 1e-3, lora=None) -> tuple:
    """A tiny ``family`` model made under ``work/name``, its packed trainer (``lora``: a LoraConfig) and the fixed
    batch the ``tiny`` part trains on."""
    from megarl.models.tiny import TinyShape, hf_config

    cfg = {**hf_config(TinyShape(family=family), eos_id=1, pad_id=0), "torch_dtype": "float32"}
    trainer = packed_trainer(write_model(work / name, cfg, seed=3), microbatch_tokens=256, lr=lr, lora=lora)
    return trainer, random_batch(cfg["vocab_size"], rows=16, prompt=8, response=40, seed=1)


def fit(trainer, batch, steps: int) -> dict:
    """``steps`` NLL steps of ``trainer`` on ``batch``: the losses, all finite, the last below the first."""
    losses = [trainer.train_step(batch, nll)["loss"] for _ in range(steps)]
    return {"losses": losses, "finite": all(map(math.isfinite, losses)), "falling": losses[-1] < losses[0],
            "device": str(trainer.device)}


def plan_estimate(hf: dict, gpu_name: str, gpu_mem_gib: float, batch: dict = BIG_BATCH) -> dict:
    """``megarl plan``'s figures for one trainer step on ``batch`` (``BIG_BATCH``'s keys) of ``hf``'s model on one
    GPU (the h200 preset for an H200, else h100's): bf16, packed micro-batches, one policy forward and backward and
    one optimizer step (no reference, proximal or R2 pass: what ``big`` runs). ``train_s``: its train seconds;
    ``trainer_gib``: its trainer memory parts (weights, gradients, Adam, activations, logits; not the engine's nor
    the CUDA context)."""
    from megarl.config import load_config
    from megarl.launch.gpus import PRESETS
    from megarl.launch.memory import TRAINER_PARTS
    from megarl.launch.plan import plan
    from megarl.launch.step_time import MFU, Work

    seq = batch["prompt"] + batch["response"]
    cfg = load_config(None, [
        "model.path=gpu_check", "trainer.precision=bf16", "trainer.packing=true",
        f"trainer.max_tokens_per_microbatch={batch['microbatch_tokens']}", f"engine.max_model_len={seq}",
        f"rollout.max_new_tokens={batch['response']}", f"rollout.prompts_per_step={batch['sequences'] // 2}",
        "rollout.samples_per_prompt=2", "algo.ppo_epochs=1", "algo.minibatches=1", "algo.kl_coef=0",
        "algo.tis=none", "algo.decoupled_ppo=false", "engine.kv_cache_gib=2"])
    preset = PRESETS["h200" if "H200" in gpu_name.upper() else "h100"]
    work = Work(batch["sequences"], batch["prompt"], batch["response"], batch["response"], MFU["dense"])
    res = plan(hf, cfg, 1, 1, gpu_mem_gib, precision="bf16", gpu=preset, work=work)
    mem, train = res["memory_gib_per_gpu"], res["step_time"]["train"]
    return {"preset": preset.name, "train_s": train["total_s"], "flops": train["flops"], "mfu": train["mfu"],
            "peak_tflops": train["peak_tflops"], "trainer_gib": sum(mem[k] for k in TRAINER_PARTS),
            "parts_gib": {k: mem[k] for k in TRAINER_PARTS}, "tokens": train["tokens"]}


def big(steps: int, work: Path, cfg: dict = LLAMA_1B, batch: dict = BIG_BATCH) -> dict:
    """The 1B-class model's optimizer step (``cfg``, on ``batch``): seconds (median of ``steps`` after two warm-up
    steps) and peak memory, against ``plan_estimate``."""
    import torch

    cuda = torch.cuda.is_available()
    start = time.perf_counter()
    model = write_model(work / "big", cfg)
    made = time.perf_counter() - start
    trainer = packed_trainer(model, batch["microbatch_tokens"], lr=1e-5)
    built = time.perf_counter() - start - made
    shutil.rmtree(model)
    rows = random_batch(cfg["vocab_size"], batch["sequences"], batch["prompt"], batch["response"], seed=2, vary=False)
    losses = [trainer.train_step(rows, nll)["loss"] for _ in range(2)]  # (the first allocates Adam's state)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(steps):
        t = time.perf_counter()
        losses.append(trainer.train_step(rows, nll)["loss"])
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t)
    step_s = statistics.median(seconds)
    gpu, gpu_gib = "cpu", 80.0
    peak = reserved = float("nan")
    if cuda:
        props = torch.cuda.get_device_properties(0)
        gpu, gpu_gib = props.name, props.total_memory / 2**30
        peak, reserved = torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30
    est = plan_estimate(cfg, gpu, gpu_gib, batch)
    return {"model": "Llama-3.2-1B shapes" if cfg is LLAMA_1B else cfg["model_type"], "batch": batch,
            "params": sum(p.numel() for m in trainer.modules for p in m.parameters()), "tokens": est["tokens"],
            "make_model_s": made, "build_trainer_s": built, "step_s": seconds, "step_s_median": step_s,
            "plan_train_s": est["train_s"], "step_over_plan": step_s / est["train_s"],
            "mfu_measured": est["flops"] / step_s / (est["peak_tflops"] * 1e12), "mfu_plan": est["mfu"],
            "peak_allocated_gib": peak, "peak_reserved_gib": reserved, "plan_trainer_gib": est["trainer_gib"],
            "plan_parts_gib": est["parts_gib"], "peak_over_plan": peak / est["trainer_gib"], "preset": est["preset"],
            "losses": losses, "ok": all(map(math.isfinite, losses))}


def run_part(part: str, out_dir: Path, steps: int) -> dict:
    """One part in a fresh interpreter; its JSON line, or why it gave none."""
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    try:
        proc = subprocess.run([sys.executable, __file__, str(out_dir), "--part", part, "--steps", str(steps)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S[part])
    except subprocess.TimeoutExpired as exc:
        return {"ok": False, "error": f"no result within {TIMEOUT_S[part]} s",
                "output": ((exc.stdout or b"") + (exc.stderr or b"")).decode(errors="replace")[-4000:]}
    found = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not found:
        return {"ok": False, "error": f"exit {proc.returncode}", "output": (proc.stdout + proc.stderr)[-4000:]}
    return json.loads(found[-1])


def summary_line(part: str, r: dict) -> str:
    """One line a part's figures come to."""
    if "skipped" in r or "error" in r:
        return f"{part}: {'SKIPPED' if 'skipped' in r else 'FAILED'}: {r.get('skipped') or r.get('error')}"
    verdict = "ok" if r.get("ok") else "FAILED"
    if part in ("kernels", "collectives"):
        return f"{part}: {verdict}: {r['summary']}"
    if part == "tiny":
        return "tiny: " + verdict + ": " + "; ".join(
            f"{f} loss {r[f]['losses'][0]:.3f} -> {r[f]['losses'][-1]:.3f}" for f in ("qwen3_moe", "qwen2",
                                                                                      "qwen3_moe_lora")) + \
            (f"; host reference gap {r['host_reference']['reference_gap']:g}" if "host_reference" in r else "")
    return (f"big: {verdict}: step {r['step_s_median']:.3f} s, plan {r['plan_train_s']:.3f} s "
            f"(x{r['step_over_plan']:.2f}; "
            f"MFU {r['mfu_measured']:.2f}, plan assumes {r['mfu_plan']:.2f}); peak {r['peak_allocated_gib']:.2f} GiB "
            f"allocated, plan's trainer {r['plan_trainer_gib']:.2f} GiB (x{r['peak_over_plan']:.2f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="directory of figures.json (and the kernels' build)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps of each tiny model; timed 1B steps")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # (one part, in this process)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part:
        with tempfile.TemporaryDirectory(dir=out) as work:
            run = globals()[args.part]
            r = run(out) if args.part in ("kernels", "collectives") else run(args.steps, Path(work))
        print(json.dumps(r), flush=True)
        return 0
    parts = [p for p in args.parts.split(",") if p]
    if unknown := [p for p in parts if p not in PARTS]:
        parser.error(f"--parts: {', '.join(unknown)} unknown; valid: {', '.join(PARTS)}")
    figures = {"setup": setup()}
    (out / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")
    s = figures["setup"]
    print(f"setup: python {s['python']}, torch {s['torch']} (CUDA {s['torch_cuda']}), nvcc {s['nvcc']}, "
          f"GPU {s.get('gpu', {}).get('name')}", flush=True)
    for module, why in s["left_out"].items():
        print(f"left out: {why}: {module} is not installed", flush=True)
    if not s["torch"].startswith(TORCH + "."):
        print(f"note: torch {s['torch']} here, megarl pins {TORCH}: the figures are this torch's", flush=True)
    if not s["cuda"]:
        print(f"gpu_check: no CUDA device here (torch.cuda.is_available() is False): stopped after the setup; "
              f"its figures are in {out / 'figures.json'}", file=sys.stderr)
        return NO_CUDA
    for part in parts:
        missing = [m for m in NEEDS[part] if not s["modules"][m]]
        figures[part] = ({"ok": False, "skipped": f"needs {', '.join(missing)}, not installed"} if missing
                         else run_part(part, out, args.steps))
        (out / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")
        print(summary_line(part, figures[part]), flush=True)
    return 0 if all(figures[p].get("ok") for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
