#!/usr/bin/env bash
# DAPO on Qwen3-235B-A22B (MoE, 128 experts, 8 active) on 8 nodes of 8 × 141 GiB GPUs (H200), bf16: the MoE recipe
# configs/qwen3-30b-a3b-dapo.yaml (DAPO-Math-17k, math-verify rewards, responses up to 20,480 tokens, AIME 2024
# held out, full recompute) with this model's layout: trainer TP 4 + sequence parallel, PP 2, experts over EP 32
# with expert TP 1, DP 8; four colocated vLLM engines of TP 16, one per two nodes (megarl plan: TP 8 engines do not
# fit beside the trainer, one TP-64 engine decodes ~2× slower).
#
#   MODEL_PATH=/models/Qwen3-235B-A22B DATA_DIR=/data/dapo examples/qwen3-235b-a22b.sh [key=value ...]
#   PLAN_ONLY=1 examples/qwen3-235b-a22b.sh
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

NODES=${NODES:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TRAINER_GPUS_PER_NODE=${TRAINER_GPUS_PER_NODE:-$GPUS_PER_NODE}
GPU_MEM_GIB=${GPU_MEM_GIB:-141}
GPU=${GPU:-h200}
MODEL_PATH=${MODEL_PATH:-/models/Qwen3-235B-A22B}
DATA_DIR=${DATA_DIR:-data}
DATA_DIR=$(run_dir "$DATA_DIR")
RUN_DIR=${RUN_DIR:-runs/qwen3-235b-a22b}
RUN_DIR=$(run_dir "$RUN_DIR")
plan_model "$MODEL_PATH" "$ROOT/examples/models/qwen3-235b-a22b.json"
SBATCH_ARGS=(--job-name=megarl-235b --gpus-per-node="$GPUS_PER_NODE" --exclusive)

RECIPE=(--config "$ROOT/configs/qwen3-30b-a3b-dapo.yaml")  # rollout, DAPO, data keys, reward: see there
MODEL=(model.path="$MODEL_PATH")
PARALLEL=(parallel.tp=4 parallel.pp=2 parallel.ep=32 parallel.etp=1 engine.tensor_parallel_size=16)
DATA=(data.path="$DATA_DIR/dapo-math-17k.parquet" data.eval_path="$DATA_DIR/aime-2024.parquet")
CHECKPOINT=(train.run_dir="$RUN_DIR" train.steps=300)

ARGS=("${RECIPE[@]}" "${MODEL[@]}" "${PARALLEL[@]}" "${DATA[@]}" "${CHECKPOINT[@]}" "$@")
submit
