#!/usr/bin/env bash
# GRPO on Qwen2.5-32B (dense) on one node of 8 × 141 GiB GPUs (H200), fp32 as megarl trains today:
# trainer TP 8 with sequence parallelism, one vLLM engine with TP 8 colocated on the same GPUs.
#
#   MODEL_PATH=/models/Qwen2.5-32B examples/qwen2.5-32b.sh [key=value ...]
#   PLAN_ONLY=1 examples/qwen2.5-32b.sh parallel.tp=4 parallel.pp=2 engine.tensor_parallel_size=4   # another layout
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

NODES=${NODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TRAINER_GPUS_PER_NODE=${TRAINER_GPUS_PER_NODE:-$GPUS_PER_NODE}
GPU_MEM_GIB=${GPU_MEM_GIB:-141}
MODEL_PATH=${MODEL_PATH:-/models/Qwen2.5-32B}
RUN_DIR=${RUN_DIR:-runs/qwen2.5-32b}
RUN_DIR=$(run_dir "$RUN_DIR")
plan_model "$MODEL_PATH" "$ROOT/examples/models/qwen2.5-32b.json"
SBATCH_ARGS=(--job-name=megarl-32b --gpus-per-node="$GPUS_PER_NODE" --exclusive)

MODEL=(model.path="$MODEL_PATH")
PARALLEL=(parallel.tp=8 parallel.sequence_parallel=true parallel.pp=1 engine.tensor_parallel_size=8
          optim.micro_batch_size=1 optim.logprob_chunk=1024)
ROLLOUT=(rollout.prompts_per_step=32 rollout.samples_per_prompt=8 rollout.max_new_tokens=3072
         engine.max_model_len=4096 engine.slots=64 engine.kv_cache_gib=16)
ALGO=(algo.preset=grpo optim.lr=1.0e-6 warmup.steps=0)
CHECKPOINT=(train.run_dir="$RUN_DIR" train.steps=500)

ARGS=("${MODEL[@]}" "${PARALLEL[@]}" "${ROLLOUT[@]}" "${ALGO[@]}" "${CHECKPOINT[@]}" "$@")
submit
