#!/usr/bin/env bash
# The tiny CPU run (configs/tiny_cpu.yaml: a tiny Qwen3-MoE policy, GRPO on short additions, 4 steps)
# through the same path as the cluster examples: `megarl plan`, then sbatch slurm/train.sbatch.
#
#   examples/tiny_cpu.sh                          # 2 nodes × 1 process, each with its own vLLM engine
#   ENGINE_TP=2 examples/tiny_cpu.sh              # one engine with TP 2 across the nodes (vLLM CPU names its
#                                                 # shared memory alike in every run: one such run per machine)
#   NODES=1 examples/tiny_cpu.sh train.steps=8    # any key=value is passed on to megarl train
#   PLAN_ONLY=1 examples/tiny_cpu.sh              # only print the plan
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

NODES=${NODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-1}  # processes per node (CPU)
TRAINER_GPUS_PER_NODE=${TRAINER_GPUS_PER_NODE:-$GPUS_PER_NODE}
GPU_MEM_GIB=${GPU_MEM_GIB:-8}      # memory per process
RUN_DIR=${RUN_DIR:-runs/tiny_cpu}
RUN_DIR=$(run_dir "$RUN_DIR")
PLAN_MODEL=()                      # the config's make_tiny shape
PLAN_ARGS=(--cpu)                  # CPU processes: no CUDA runtime in the plan
SBATCH_ARGS=(--job-name=megarl-tiny)

MODEL=(--config "$ROOT/configs/tiny_cpu.yaml" model.path="$RUN_DIR/model")
PARALLEL=(parallel.tp=1 parallel.pp=1 engine.tensor_parallel_size="${ENGINE_TP:-1}")
ROLLOUT=(rollout.prompts_per_step=4 rollout.samples_per_prompt=2 rollout.max_new_tokens=16)
ALGO=(algo.preset=grpo)
CHECKPOINT=(train.run_dir="$RUN_DIR")

ARGS=("${MODEL[@]}" "${PARALLEL[@]}" "${ROLLOUT[@]}" "${ALGO[@]}" "${CHECKPOINT[@]}" "$@")
submit
