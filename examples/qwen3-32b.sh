#!/usr/bin/env bash
# DAPO on Qwen3-32B (dense) on 4 nodes of 8 × 80 GiB GPUs (H100), bf16: the recipe configs/qwen3-32b-dapo.yaml
# (DAPO-Math-17k, math-verify rewards, responses up to 20,480 tokens, AIME 2024 held out) with its layout:
# trainer TP 8 (a node) + sequence parallel, DP 4 with the distributed optimizer, full recompute; four colocated
# vLLM engines of TP 8, one a node. On 2 nodes: NODES=2 ... engine.kv_cache_gib=16 (slower).
#
#   MODEL_PATH=/models/Qwen3-32B DATA_DIR=/data/dapo examples/qwen3-32b.sh [key=value ...]
#   PLAN_ONLY=1 NODES=2 examples/qwen3-32b.sh engine.kv_cache_gib=16    # print the plan only
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

NODES=${NODES:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TRAINER_GPUS_PER_NODE=${TRAINER_GPUS_PER_NODE:-$GPUS_PER_NODE}
GPU_MEM_GIB=${GPU_MEM_GIB:-80}
MODEL_PATH=${MODEL_PATH:-/models/Qwen3-32B}
DATA_DIR=${DATA_DIR:-data}
DATA_DIR=$(run_dir "$DATA_DIR")
RUN_DIR=${RUN_DIR:-runs/qwen3-32b}
RUN_DIR=$(run_dir "$RUN_DIR")
plan_model "$MODEL_PATH" "$ROOT/examples/models/${MODEL_SHAPE:-qwen3-32b}.json"  # (qwen2.5-32b.sh: its own)
SBATCH_ARGS=(--job-name=megarl-32b --gpus-per-node="$GPUS_PER_NODE" --exclusive)

RECIPE=(--config "$ROOT/configs/qwen3-32b-dapo.yaml")  # layout, rollout, DAPO, data keys, reward: see there
MODEL=(model.path="$MODEL_PATH")
DATA=(data.path="$DATA_DIR/dapo-math-17k.parquet" data.eval_path="$DATA_DIR/aime-2024.parquet")
CHECKPOINT=(train.run_dir="$RUN_DIR")

ARGS=("${RECIPE[@]}" "${MODEL[@]}" "${DATA[@]}" "${CHECKPOINT[@]}" "$@")
submit
