# shellcheck shell=bash
# Sourced by the example launch scripts: check the layout with `megarl plan`, then submit
# slurm/train.sbatch with the same arguments. The caller sets NODES, GPUS_PER_NODE,
# GPU_MEM_GIB, RUN_DIR, PLAN_MODEL (array), SBATCH_ARGS (array) and ARGS (array: the flags).
#   -h, --help    print the script's usage (its header comment) and stop (nothing is submitted)
#   PLAN_ONLY=1   print the plan and stop (nothing is submitted)
#   PYTHON        the interpreter with megarl installed (default: the repository's .venv/bin/python, as `make`
#                 installs it, else python3)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# --help / -h anywhere among the script's arguments (sourcing keeps them): its header comment, then exit
for arg in "$@"; do
    if [[ $arg == -h || $arg == --help ]]; then
        sed -n '2,/^[^#]/{/^#/!d;/shellcheck/d;s/^# \{0,1\}//;p}' "$0"
        echo "(PLAN_ONLY=1 prints the plan alone; any key=value is passed on to megarl train)"
        exit 0
    fi
done
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python3
    if [[ -x $ROOT/.venv/bin/python ]]; then
        PYTHON=$ROOT/.venv/bin/python
    fi
fi
export PYTHON GPUS_PER_NODE

submit() {
    local status=0
    "$PYTHON" -m megarl.cli plan --nodes "$NODES" --gpus-per-node "$GPUS_PER_NODE" --gpu-mem-gib "$GPU_MEM_GIB" \
        "${PLAN_MODEL[@]}" "${ARGS[@]}" || status=$?
    if ((status == 1)) && ! "$PYTHON" -c 'import megarl.launch.plan, torch' 2>/dev/null; then
        # exit 1 is also Python's for a crash: an interpreter that cannot import megarl did not plan anything
        echo "could not run megarl plan with PYTHON=$PYTHON (it cannot import megarl or torch); set" \
            "PYTHON=/path/to/.venv/bin/python (the interpreter megarl is installed in): nothing submitted" >&2
        exit 1
    fi
    if ((status != 0)); then
        echo "megarl plan refused this layout (exit $status): nothing submitted" >&2
        exit "$status"
    fi
    if [[ ${PLAN_ONLY:-0} == 1 ]]; then
        return 0
    fi
    mkdir -p "$RUN_DIR/logs"
    sbatch --parsable --nodes "$NODES" --output "$RUN_DIR/logs/%j.batch.log" "${SBATCH_ARGS[@]}" \
        "$ROOT/slurm/train.sbatch" "${ARGS[@]}"
}

# The model's shape for the plan: the checkpoint's config.json if it is there, else the shape file.
plan_model() {
    if [[ -f $1/config.json ]]; then
        PLAN_MODEL=(--model "$1")
    else
        PLAN_MODEL=(--model "$2")
    fi
}
