"""Host memory of the trainer's HF load, side by side in one run: the sliced reader against the whole-file path.

    python bench/load_memory.py [--out DIR]

Writes two checkpoints with transformers (no download; in ``--out``, a temporary directory by default): a dense
Qwen3 of 1.36 GB (2 layers, vocabulary 65536, hidden 2048, fp32, 3 safetensors files) and a Qwen3-MoE of 1.10 GB
(2 layers of 64 experts, 4 files). Then, in processes of their own (``tests/workers/load_checks.py``, megatron-core
on gloo): TP 1 (one rank) and TP 2 (two) on the dense checkpoint, EP 2 (two) on the MoE one. Each rank builds its
model chunks, then measures what a load adds to its host memory, peak RSS during the load minus RSS before it
(Linux's VmHWM, reset to the current RSS by ``clear_refs`` 5 just before): ``load_hf_weights`` (the rank's slices
read from the files), then the former whole-file path (every tensor of every file, converted, then cut: kept in
``tests/helpers/hf_loading.py`` as the reference) into a second model built alike. Both include the parameters' own
pages, which the model's build leaves untouched (``torch.empty``) and the load writes: the shard's share is the
floor. One line per layout, each figure the largest over its ranks, as a fraction of the checkpoint's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

DENSE = dict(vocab_size=65536, hidden_size=2048, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
             head_dim=128, intermediate_size=4096)
MOE = dict(vocab_size=32768, hidden_size=1024, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
           head_dim=128, intermediate_size=2048, num_experts=64, num_experts_per_tok=4, moe_intermediate_size=512)
LAYOUTS = [("TP 1", "dense", "single", 1), ("TP 2", "dense", "tp2", 2), ("EP 2", "moe", "ep2_alltoall", 2)]


def measure(check: str, nproc: int) -> list[dict]:
    """``tests/workers/load_checks.py CHECK`` under torchrun, the environment as it is (no thread count set: what
    torchrun and megarl choose) but for the allocator's threshold that lets a freed buffer leave RSS; each rank's
    figures."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           "tests/workers/load_checks.py", check], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{check} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])[check]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="", help="where to write the two checkpoints (default: a temporary dir)")
    args = parser.parse_args()
    from helpers.hf_models import make_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        models = {"dense": make_hf_model(root / "dense", "qwen3", seed=0, max_shard_size="300MB", tokenizer=False,
                                         **DENSE),
                  "moe": make_hf_model(root / "moe", "qwen3_moe", seed=0, max_shard_size="300MB", tokenizer=False,
                                       **MOE)}
        for label, kind, layout, nproc in LAYOUTS:
            check = f"memory:{models[kind]}:{layout}"
            ranks = measure(check, nproc)
            ckpt = ranks[0]["checkpoint_bytes"]
            sliced, whole, shard = (max(r[key] for r in ranks) / ckpt for key in ("sliced", "whole", "shard_bytes"))
            assert all(r["same"] for r in ranks), f"{label}: the two paths loaded different parameters"
            print(f"load memory {label} ({nproc} rank{'s' if nproc > 1 else ''}, {kind} checkpoint "
                  f"{ckpt / 1e9:.2f} GB in {ranks[0]['files']} files): added peak RSS / checkpoint bytes: sliced "
                  f"{sliced:.3f} vs whole-file {whole:.3f} (the rank's shard alone: {shard:.3f})", flush=True)


if __name__ == "__main__":
    main()
