#!/bin/bash
# Hugging Face -> Megatron-Core checkpoint conversion (one task; streams tensors).
#
#   STABLEDRL_HF_DIR=/path/to/LLaDA-8B-Instruct slurm/submit.sh [--partition=P] [--account=A] slurm/convert.sh
#
# Submit with slurm/submit.sh (from anywhere), or sbatch from the repository root (or set
# STABLEDRL_ROOT). Environment, defaults:
#   STABLEDRL_MODEL=llada-8b        a preset (llada-8b | sdar-8b | ...: the checkpoint must have its
#                                   shape) or an architecture (llada | sdar: any shape)
#   STABLEDRL_HF_DIR                Hugging Face checkpoint directory (required)
#   STABLEDRL_OUT=checkpoints/llada-8b-instruct-mcore (llada-8b) or
#                 checkpoints/sdar-8b-chat-mcore (sdar-8b): where the 8B recipes load from
#   STABLEDRL_TP=1  STABLEDRL_PP=1  layout written (Megatron dist checkpoints reshard on load)
#   STABLEDRL_RUN_DIR=runs/convert_<model>  (logs)  STABLEDRL_PYTHON=python  STABLEDRL_DEVICE=gpu
#SBATCH --job-name=stabledrl-convert
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --mem=0
#SBATCH --time=02:00:00
#SBATCH --output=slurm-%x-%j.out

# The repository: STABLEDRL_ROOT (slurm/submit.sh sets it at submit time), else the submit
# directory (sbatch runs a spooled copy of this file, so its own path says nothing).
_root=${STABLEDRL_ROOT:-${SLURM_SUBMIT_DIR:-.}}
if [[ ! -f "$_root/slurm/common.sh" ]]; then
    echo "stabledrl: error: $_root is not the stabledrl_mcore repository (no slurm/common.sh): submit with" \
        "slurm/submit.sh (finds it at submit time), from the repository root, or set STABLEDRL_ROOT" >&2
    exit 2
fi
# shellcheck source=slurm/common.sh
source "$_root/slurm/common.sh"
MODEL=${STABLEDRL_MODEL:-llada-8b}
case "$MODEL" in
    llada-8b) default_out=checkpoints/llada-8b-instruct-mcore ;;
    sdar-8b) default_out=checkpoints/sdar-8b-chat-mcore ;;
    *) default_out="" ;;
esac
OUT=${STABLEDRL_OUT:-$default_out}
[[ -n "${STABLEDRL_HF_DIR:-}" ]] || sdrl_die "set STABLEDRL_HF_DIR to the Hugging Face checkpoint directory"
[[ -n "$OUT" ]] || sdrl_die "set STABLEDRL_OUT (no default output for model '$MODEL')"
sdrl_setup
mkdir -p "$(dirname "$(realpath -m "$OUT")")"
SDRL_MOUNT_PATHS=("$(realpath -m "$STABLEDRL_HF_DIR")" "$(dirname "$(realpath -m "$OUT")")")  # with STABLEDRL_CONTAINER
sdrl_log_dir "${STABLEDRL_RUN_DIR:-runs/convert_$MODEL}"
sdrl_run_step "$STABLEDRL_PYTHON" -m stabledrl_mcore.cli convert hf-to-mcore --model "$MODEL" \
    --hf-dir "$STABLEDRL_HF_DIR" --out "$OUT" --tp "${STABLEDRL_TP:-1}" --pp "${STABLEDRL_PP:-1}"
