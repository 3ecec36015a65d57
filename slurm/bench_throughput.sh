#!/bin/bash
# Per-phase throughput and MFU (`stabledrl bench`) of a recipe on one 8-GPU node.
#
#   slurm/submit.sh [--nodes=N] [--partition=P] [--account=A] slurm/bench_throughput.sh [KEY=VALUE ...]
#
# Submit with slurm/submit.sh (from anywhere), or sbatch from the repository root (or set
# STABLEDRL_ROOT). Environment, defaults:
#   STABLEDRL_CONFIG=examples/configs/llada_8b_stabledrl.yaml  STABLEDRL_OVERRIDES=""
#   STABLEDRL_RUN_DIR=<config logging.run_dir>  STABLEDRL_PYTHON=python  STABLEDRL_DEVICE=gpu
#   STABLEDRL_ENV_SETUP  STABLEDRL_CONTAINER  STABLEDRL_MOUNTS   (cluster environment: slurm/README.md)
#   STABLEDRL_BENCH_JSON=<run_dir>/logs/<job>/restart_0/bench.json
#   MASTER_ADDR=<first node>  MASTER_PORT=<20000 + job id % 20000>   (details: slurm/common.sh)
#SBATCH --job-name=stabledrl-bench
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=01:00:00
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
sdrl_bench "$STABLEDRL_ROOT/examples/configs/llada_8b_stabledrl.yaml" "$@"
