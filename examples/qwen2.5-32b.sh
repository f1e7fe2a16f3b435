#!/usr/bin/env bash
# DAPO on Qwen2.5-32B (dense; the base model is the DAPO paper's own) on 4 nodes of 8 × 80 GiB GPUs (H100), bf16:
# the dense recipe configs/qwen3-32b-dapo.yaml (DAPO-Math-17k, math-verify rewards, responses up to 20,480 tokens,
# AIME 2024 held out) sized for this model's shape: trainer TP 8 (a node) + sequence parallel, DP 4 with the
# distributed optimizer, full recompute; four colocated vLLM engines of TP 8, one a node.
#
#   MODEL_PATH=/models/Qwen2.5-32B DATA_DIR=/data/dapo examples/qwen2.5-32b.sh [key=value ...]
#   PLAN_ONLY=1 NODES=2 examples/qwen2.5-32b.sh engine.kv_cache_gib=16      # 2 nodes: a smaller KV cache
set -euo pipefail
# the dense recipe's script with this model's defaults (its shape for the plan: examples/models/qwen2.5-32b.json)
MODEL_PATH=${MODEL_PATH:-/models/Qwen2.5-32B} RUN_DIR=${RUN_DIR:-runs/qwen2.5-32b} MODEL_SHAPE=qwen2.5-32b \
    exec "$(dirname "${BASH_SOURCE[0]}")/qwen3-32b.sh" "$@"
