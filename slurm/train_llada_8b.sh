#!/bin/bash
# StableDRL on LLaDA-8B-Instruct: full-parameter RL, one task per GPU, several 8-GPU nodes.
#
#   slurm/submit.sh [--nodes=N] [--partition=P] [--account=A] [--time=T] slurm/train_llada_8b.sh [KEY=VALUE ...]
#
# Submit with slurm/submit.sh (from anywhere), or sbatch from the repository root (or set
# STABLEDRL_ROOT). Environment, defaults:
#   STABLEDRL_CONFIG=examples/configs/llada_8b_stabledrl.yaml  STABLEDRL_OVERRIDES=""
#   STABLEDRL_RUN_DIR=<config logging.run_dir>  STABLEDRL_PYTHON=python  STABLEDRL_DEVICE=gpu
#   STABLEDRL_ENV_SETUP  STABLEDRL_CONTAINER  STABLEDRL_MOUNTS   (cluster environment: slurm/README.md)
#   MASTER_ADDR=<first node>  MASTER_PORT=<20000 + job id % 20000>   (details: slurm/common.sh)
# Pipeline parallelism: STABLEDRL_CONFIG=examples/configs/llada_8b_stabledrl_tp4pp2.yaml with
# --nodes=2 runs the recipe at TP=4 x PP=2 (DP=2).
# Pre-emption: USR1 arrives 30 min before the time limit (a recipe step takes ~11 min on
# 2 nodes, plus the save); ranks checkpoint, exit 75, the job requeues itself and resumes
# with --resume auto. The trainer warns when that lead is too short for the measured times.
# CPU-only clusters: add --gpus-per-node=0 and set STABLEDRL_DEVICE=cpu (see slurm/README.md).
#SBATCH --job-name=stabledrl-llada-8b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@1800
#SBATCH --requeue
#SBATCH --open-mode=append
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
sdrl_train "$STABLEDRL_ROOT/examples/configs/llada_8b_stabledrl.yaml" "$@"
