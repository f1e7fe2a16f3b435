#!/usr/bin/env bash
# GRPO on Qwen3-235B-A22B (MoE, 128 experts, 8 active) on 8 nodes of 8 × 141 GiB GPUs (H200), fp32:
# trainer TP 4 + sequence parallel, PP 2, experts over EP 32 with expert TP 1, DP 8; one vLLM engine
# with TP 64 colocated (megarl's engine spans all processes or one).
#
#   MODEL_PATH=/models/Qwen3-235B-A22B examples/qwen3-235b-a22b.sh [key=value ...]
#   PLAN_ONLY=1 examples/qwen3-235b-a22b.sh
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

NODES=${NODES:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TRAINER_GPUS_PER_NODE=${TRAINER_GPUS_PER_NODE:-$GPUS_PER_NODE}
GPU_MEM_GIB=${GPU_MEM_GIB:-141}
MODEL_PATH=${MODEL_PATH:-/models/Qwen3-235B-A22B}
RUN_DIR=${RUN_DIR:-runs/qwen3-235b-a22b}
RUN_DIR=$(run_dir "$RUN_DIR")
plan_model "$MODEL_PATH" "$ROOT/examples/models/qwen3-235b-a22b.json"
SBATCH_ARGS=(--job-name=megarl-235b --gpus-per-node="$GPUS_PER_NODE" --exclusive)

MODEL=(model.path="$MODEL_PATH")
PARALLEL=(parallel.tp=4 parallel.sequence_parallel=true parallel.pp=2 parallel.ep=32 parallel.etp=1
          parallel.moe_dispatcher=alltoall engine.tensor_parallel_size=64
          optim.micro_batch_size=1 optim.logprob_chunk=1024 optim.moe_aux_loss_coeff=0.001)
ROLLOUT=(rollout.prompts_per_step=32 rollout.samples_per_prompt=8 rollout.max_new_tokens=3072
         engine.max_model_len=4096 engine.slots=64 engine.kv_cache_gib=24)
ALGO=(algo.preset=grpo optim.lr=5.0e-7 warmup.steps=0)
CHECKPOINT=(train.run_dir="$RUN_DIR" train.steps=300)

ARGS=("${MODEL[@]}" "${PARALLEL[@]}" "${ROLLOUT[@]}" "${ALGO[@]}" "${CHECKPOINT[@]}" "$@")
submit
