#!/bin/bash
# StableDRL on SDAR-30B-A3B-Chat (mixture of experts, block diffusion): one task per GPU, one node
# of 8 GPUs at expert parallelism 8 (examples/configs/sdar_30b_a3b_stabledrl.yaml).
#
#   slurm/submit.sh [--nodes=N] [--partition=P] [--account=A] [--time=T] slurm/train_sdar_30b_a3b.sh [KEY=VALUE ...]
#
# Submit with slurm/submit.sh (from anywhere), or sbatch from the repository root (or set
# STABLEDRL_ROOT). Environment, defaults:
#   STABLEDRL_CONFIG=examples/configs/sdar_30b_a3b_stabledrl.yaml  STABLEDRL_OVERRIDES=""
#   STABLEDRL_RUN_DIR=<config logging.run_dir>  STABLEDRL_PYTHON=python  STABLEDRL_DEVICE=gpu
#   STABLEDRL_ENV_SETUP  STABLEDRL_CONTAINER  STABLEDRL_MOUNTS   (cluster environment: slurm/README.md)
#   MASTER_ADDR=<first node>  MASTER_PORT=<20000 + job id % 20000>   (details: slurm/common.sh)
# Memory (`stabledrl plan`, the recipe's header): 78.7 GiB of 80 per GPU on one node at
# expert-data-parallel 1; --nodes=2 (expert-data-parallel 2) models 57.4 GiB.
# Pre-emption: USR1 arrives 30 min before the time limit (no step time is measured for this model
# yet); ranks checkpoint, exit 75, the job requeues itself and resumes with --resume auto. The
# trainer warns when that lead is too short for the measured times.
#SBATCH --job-name=stabledrl-sdar-30b-a3b
#SBATCH --nodes=1
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
sdrl_train "$STABLEDRL_ROOT/examples/configs/sdar_30b_a3b_stabledrl.yaml" "$@"
