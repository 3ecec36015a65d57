#!/bin/bash
# StableDRL on SDAR-8B-Chat (block diffusion, staircase block likelihoods): one task per GPU.
#
#   sbatch [--nodes=N] [--partition=P] [--account=A] [--time=T] slurm/train_sdar_8b.sh [KEY=VALUE ...]
#
# Submit from the repository root (or set STABLEDRL_ROOT). Environment, defaults:
#   STABLEDRL_CONFIG=examples/configs/sdar_8b_stabledrl.yaml  STABLEDRL_OVERRIDES=""
#   STABLEDRL_RUN_DIR=<config logging.run_dir>  STABLEDRL_PYTHON=python  STABLEDRL_DEVICE=gpu
#   MASTER_ADDR=<first node>  MASTER_PORT=<20000 + job id % 20000>   (details: slurm/common.sh)
# Pre-emption: USR1 arrives 10 min before the time limit; ranks checkpoint, exit 75, the
# job requeues itself and resumes with --resume auto.
#SBATCH --job-name=stabledrl-sdar-8b
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

# shellcheck source=slurm/common.sh
source "${STABLEDRL_ROOT:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}/slurm/common.sh"
sdrl_train "$STABLEDRL_ROOT/examples/configs/sdar_8b_stabledrl.yaml" "$@"
