#!/usr/bin/env bash
# DAPO on Qwen3-30B-A3B (MoE, 128 experts, 8 active) on 2 nodes of 8 × 80 GiB GPUs, fp32:
# trainer TP 2 + sequence parallel, experts over EP 16 with expert TP 1, DP 8 with the distributed
# optimizer; two colocated vLLM engines of TP 8, one a node (megarl plan: one TP-16 engine across both nodes
# decodes ~2× slower, memory-bound and with an all-reduce over the network every layer).
#
#   MODEL_PATH=/models/Qwen3-30B-A3B examples/qwen3-30b-a3b.sh [key=value ...]
#   PLAN_ONLY=1 examples/qwen3-30b-a3b.sh engine.kv_cache_gib=8    # print the plan only
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

NODES=${NODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TRAINER_GPUS_PER_NODE=${TRAINER_GPUS_PER_NODE:-$GPUS_PER_NODE}
GPU_MEM_GIB=${GPU_MEM_GIB:-80}
MODEL_PATH=${MODEL_PATH:-/models/Qwen3-30B-A3B}
RUN_DIR=${RUN_DIR:-runs/qwen3-30b-a3b}
RUN_DIR=$(run_dir "$RUN_DIR")
plan_model "$MODEL_PATH" "$ROOT/examples/models/qwen3-30b-a3b.json"
SBATCH_ARGS=(--job-name=megarl-30b-a3b --gpus-per-node="$GPUS_PER_NODE" --exclusive)

MODEL=(model.path="$MODEL_PATH")
PARALLEL=(parallel.tp=2 parallel.sequence_parallel=true parallel.pp=1 parallel.ep=16 parallel.etp=1
          parallel.moe_dispatcher=alltoall engine.tensor_parallel_size=8
          optim.micro_batch_size=1 optim.logprob_chunk=1024 optim.moe_aux_loss_coeff=0.001)
ROLLOUT=(rollout.prompts_per_step=32 rollout.samples_per_prompt=8 rollout.max_new_tokens=3072
         engine.max_model_len=4096 engine.slots=64 engine.kv_cache_gib=12)
ALGO=(algo.preset=dapo optim.lr=1.0e-6 warmup.steps=0)
CHECKPOINT=(train.run_dir="$RUN_DIR" train.steps=500)

ARGS=("${MODEL[@]}" "${PARALLEL[@]}" "${ROLLOUT[@]}" "${ALGO[@]}" "${CHECKPOINT[@]}" "$@")
submit
