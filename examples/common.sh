# shellcheck shell=bash
# Sourced by the example launch scripts: check the layout with `megarl plan`, then submit
# slurm/train.sbatch with the same arguments. The caller sets NODES, GPUS_PER_NODE, TRAINER_GPUS_PER_NODE,
# GPU_MEM_GIB, RUN_DIR (through run_dir: made absolute), PLAN_MODEL (array), SBATCH_ARGS (array) and
# ARGS (array: the flags).
#   -h, --help    print the script's usage (its header comment) and stop (nothing is submitted)
#   PLAN_ONLY=1   print the plan and stop (nothing is submitted)
#   MODEL_ON_NODES=1  submit although MODEL_PATH has no config.json on this machine (the plan then used the
#                 example's shape file): the model exists on the compute nodes only
#   PYTHON        the interpreter with megarl installed (default: the repository's .venv/bin/python, as `make`
#                 installs it, else python3)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# What every launch script reads from the environment, and the script's own default of each.
env_help() {
    local name what default
    while IFS='|' read -r name what; do
        default=$(sed -n "s/^$name=\${$name:-\([^}]*\)}.*/\1/p" "$1" | head -n 1)
        printf '  %-22s %s%s\n' "$name" "$what" "${default:+ (default $default)}"
    done <<'VARS'
NODES|nodes of the job (sbatch --nodes)
GPUS_PER_NODE|GPUs (on CPU: processes) per node, as sbatch asks for them
TRAINER_GPUS_PER_NODE|trainer processes per node, on GPUs 0..N-1 (fewer: the rest run replicas, engine.replica_devices)
GPU_MEM_GIB|memory per GPU (on CPU: per process) that megarl plan sizes against
GPU|the GPU megarl plan times the step on: a100, h100 (default), h200, b200 (its FLOP/s and bandwidths)
MODEL_PATH|the HF checkpoint directory, as the compute nodes see it
DATA_DIR|the recipe's datasets (dapo-math-17k.parquet, aime-2024.parquet), as the compute nodes see it
RUN_DIR|the run directory (checkpoints, logs, TensorBoard); a relative one is from where you launch
MODEL_ON_NODES|1: submit although MODEL_PATH has no config.json on this machine
PLAN_ONLY|1: print the plan and stop (nothing is submitted)
PYTHON|the interpreter megarl is installed in (default: the repository's .venv/bin/python, else python3)
MEGARL_SBATCH_ARGS|more sbatch options, split on spaces: --partition=gpu --account=proj --time=24:00:00 ...
CPUS_PER_TASK|cores of the one task a node runs (default: the fewest CPUs of a node the partition has, sinfo)
CONTAINER_IMAGE|a container (pyxis/enroot) the job steps run in, e.g. nvcr.io#nvidia/pytorch:25.01-py3
CONTAINER_MOUNTS|its mounts (pyxis --container-mounts), e.g. /models:/models,/scratch:/scratch
VARS
}

# RUN_DIR made absolute (a relative one is taken from where the script is launched), so that the job, its logs
# and the messages below name one place, whatever directory a later job or command runs in.
run_dir() {
    local dir=$1
    [[ $dir == /* ]] || dir=$PWD/$dir
    echo "$dir"
}

# --help / -h anywhere among the script's arguments (sourcing keeps them): its header comment, then exit
for arg in "$@"; do
    if [[ $arg == -h || $arg == --help ]]; then
        sed -n '2,/^[^#]/{/^#/!d;/shellcheck/d;s/^# \{0,1\}//;p}' "$0"
        echo
        echo "Environment (default in this script):"
        env_help "$0"
        echo "Any key=value is passed on to megarl train."
        exit 0
    fi
done
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python3
    if [[ -x $ROOT/.venv/bin/python ]]; then
        PYTHON=$ROOT/.venv/bin/python
    fi
fi
export PYTHON
PLAN_ARGS=()  # more megarl plan flags (tiny_cpu.sh: --cpu)

# The site's sbatch options (MEGARL_SBATCH_ARGS, split on spaces; sbatch's own SBATCH_PARTITION, SBATCH_ACCOUNT,
# SBATCH_TIMELIMIT are read by sbatch itself) after the script's, and --cpus-per-task: the job runs one task a node
# (torchrun), which Slurm would give one core by default, and megarl pins its threads to the task's cores.
site_sbatch_args() {
    local extra=() partition="${SBATCH_PARTITION:-}" arg cpus
    read -r -a extra <<<"${MEGARL_SBATCH_ARGS:-}"
    for arg in "${SBATCH_ARGS[@]}" "${extra[@]}"; do
        case $arg in
            --cpus-per-task=* | -c*) CPUS_PER_TASK=${CPUS_PER_TASK:-given} ;;
            --partition=*) partition=${arg#--partition=} ;;
            -p?*) partition=${arg#-p} ;;
        esac
    done
    SBATCH_ARGS+=("${extra[@]}")
    if [[ -z ${CPUS_PER_TASK:-} ]]; then
        cpus=$(sinfo -h -o %c ${partition:+-p "$partition"} 2>/dev/null | tr -d '+' | sort -n | head -n 1) || true
        CPUS_PER_TASK=${cpus:-}
    fi
    if [[ ${CPUS_PER_TASK:-given} != given ]]; then
        SBATCH_ARGS+=(--cpus-per-task="$CPUS_PER_TASK")
    fi
}

submit() {
    local status=0
    # slurm/train.sbatch starts TRAINER_GPUS_PER_NODE trainer processes a node; sbatch asks for GPUS_PER_NODE GPUs
    TRAINER_GPUS_PER_NODE=${TRAINER_GPUS_PER_NODE:-$GPUS_PER_NODE}
    export GPUS_PER_NODE TRAINER_GPUS_PER_NODE
    "$PYTHON" -m megarl.cli plan --nodes "$NODES" --gpus-per-node "$GPUS_PER_NODE" --gpu-mem-gib "$GPU_MEM_GIB" \
        --gpu "${GPU:-h100}" --trainer-gpus-per-node "$TRAINER_GPUS_PER_NODE" "${PLAN_MODEL[@]}" "${PLAN_ARGS[@]}" \
        "${ARGS[@]}" || status=$?
    if ((status == 1)) && ! "$PYTHON" -c 'import megarl.launch.plan, torch' 2>/dev/null; then
        # exit 1 is also Python's for a crash: an interpreter that cannot import megarl did not plan anything
        echo "could not run megarl plan with PYTHON=$PYTHON (it cannot import megarl or torch); set" \
            "PYTHON=/path/to/.venv/bin/python (the interpreter megarl is installed in): nothing submitted" >&2
        exit 1
    fi
    if ((status != 0)); then
        echo "megarl plan refused this config (exit $status): nothing submitted" >&2
        exit "$status"
    fi
    if [[ ${PLAN_ONLY:-0} == 1 ]]; then
        return 0
    fi
    if [[ -n ${MODEL_NOT_HERE:-} && ${MODEL_ON_NODES:-0} != 1 ]]; then
        echo "MODEL_PATH=$MODEL_NOT_HERE holds no config.json on this machine: nothing submitted (the job would" \
            "fail on its nodes). Set MODEL_PATH to the HF checkpoint's directory, or MODEL_ON_NODES=1 if it exists" \
            "on the compute nodes only" >&2
        exit 2
    fi
    local reach
    if ! reach=$(sinfo -h -o %P 2>&1); then  # (sbatch would fail after the run dir was made, leaving it empty)
        echo "no Slurm to submit to (sinfo: ${reach:-not found}): nothing submitted. On a cluster, run this on a" \
            "login node (SLURM_CONF set if your site needs it); to try megarl's local two-node Slurm:" \
            "eval \"\$(tests/cluster/slurm_cluster.sh start DIR)\" as root (docs/cluster.md)" >&2
        exit 1
    fi
    site_sbatch_args
    export CONTAINER_IMAGE CONTAINER_MOUNTS  # (slurm/train.sbatch runs its steps in them)
    mkdir -p "$RUN_DIR/logs"
    local job
    job=$(sbatch --parsable --nodes "$NODES" --output "$RUN_DIR/logs/%j.batch.log" "${SBATCH_ARGS[@]}" \
        "$ROOT/slurm/train.sbatch" "${ARGS[@]}")
    echo "submitted job $job; batch log $RUN_DIR/logs/${job%%;*}.batch.log" >&2  # (--parsable: ID or ID;CLUSTER)
    echo "$job"
}

# The model's shape for the plan: the checkpoint's config.json if it is there, else the shape file (said, and
# a submit is then refused unless MODEL_ON_NODES=1: the model is on the compute nodes only).
plan_model() {
    if [[ -f $1/config.json ]]; then
        PLAN_MODEL=(--model "$1")
    else
        PLAN_MODEL=(--model "$2")
        MODEL_NOT_HERE=$1
        echo "note: $1/config.json is not on this machine: planning with the shape in $2" >&2
    fi
}
