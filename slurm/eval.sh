#!/bin/bash
# `stabledrl eval` of one checkpoint across the allocation: examples sharded over the data-parallel
# ranks (one task per GPU, DP = tasks / STABLEDRL_TP), results written by rank 0.
#
#   STABLEDRL_CKPT=runs/llada_8b/checkpoints/step_00000100 STABLEDRL_TASK=gsm8k \
#     slurm/submit.sh [--nodes=N] [--partition=P] [--account=A] slurm/eval.sh [EVAL FLAGS ...]
#   e.g. ... slurm/eval.sh --n 16 --temperature 0.6 --k 1,4,16 --gen-length 256 --out results/gsm8k.jsonl
#
# Submit with slurm/submit.sh (from anywhere), or sbatch from the repository root (or set
# STABLEDRL_ROOT). Arguments are `stabledrl eval` flags (not config overrides). Environment, defaults:
#   STABLEDRL_CKPT (required)  HF directory, converted checkpoint or training checkpoint step_*
#   STABLEDRL_TASK (required)  gsm8k | math500 | countdown | sudoku | ...
#   STABLEDRL_TP=1             tensor-parallel size of each replica
#   STABLEDRL_RUN_DIR=runs/eval_<task>  (logs)  STABLEDRL_PYTHON=python  STABLEDRL_DEVICE=gpu
#   STABLEDRL_ENV_SETUP  STABLEDRL_CONTAINER  STABLEDRL_MOUNTS   (cluster environment: slurm/README.md)
#   MASTER_ADDR=<first node>  MASTER_PORT=<20000 + job id % 20000>   (details: slurm/common.sh)
# Results: --out (default ./eval_<task>_<split>.jsonl in the submit directory) and its
# .summary.json; an existing file is refused before any rank starts (pass --overwrite). A requeued
# attempt passes --resume: the rows the earlier attempt kept are not decoded again.
#SBATCH --job-name=stabledrl-eval
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --output=slurm-%x-%j.out

# The repository: STABLEDRL_ROOT (slurm/submit.sh sets it at submit time), else the submit directory.
_root=${STABLEDRL_ROOT:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}
if [[ ! -f "$_root/slurm/common.sh" ]]; then
    echo "stabledrl: error: $_root is not the stabledrl_mcore repository (no slurm/common.sh): submit with" \
        "slurm/submit.sh (finds it at submit time), from the repository root, or set STABLEDRL_ROOT" >&2
    exit 2
fi
# shellcheck source=slurm/common.sh
source "$_root/slurm/common.sh"
[[ -n "${STABLEDRL_CKPT:-}" ]] || sdrl_die "set STABLEDRL_CKPT to the checkpoint to evaluate"
[[ -n "${STABLEDRL_TASK:-}" ]] || sdrl_die "set STABLEDRL_TASK to the task (gsm8k, math500, countdown, sudoku, ...)"
for unused in STABLEDRL_CONFIG STABLEDRL_OVERRIDES; do
    [[ -z "${!unused:-}" ]] || sdrl_die "$unused is for training jobs; eval takes flags after the script name"
done
sdrl_setup
SDRL_MOUNT_PATHS=("$(realpath -m "$STABLEDRL_CKPT")")  # with STABLEDRL_CONTAINER
sdrl_log_dir "${STABLEDRL_RUN_DIR:-runs/eval_$STABLEDRL_TASK}"
# A requeued job (pre-empted, or a failed node) goes on from the rows its earlier attempt kept
# (`stabledrl eval --resume`: checked against the same checkpoint, task and sampling flags, refused
# by name if any differs); a first attempt starts fresh, an existing --out is refused.
RESUME=()
if [[ "${SLURM_RESTART_COUNT:-0}" -gt 0 && ! " $* " =~ \ --(resume|overwrite)\  ]]; then RESUME=(--resume); fi
EVAL=("$STABLEDRL_PYTHON" -m stabledrl_mcore.cli eval --ckpt "$STABLEDRL_CKPT" --task "$STABLEDRL_TASK"
      --tp "${STABLEDRL_TP:-1}" --no-progress "$@" "${RESUME[@]}")
# every input once, before any rank starts (a bad flag, data file, template or existing output)
# (inside the container when STABLEDRL_CONTAINER is set)
sdrl_python "${EVAL[@]:1}" --check || sdrl_die "eval inputs refused (above): ${EVAL[*]}"
rc=0
sdrl_run_step "${EVAL[@]}" || rc=$?
exit "$rc"
