#!/bin/bash
# Per-phase throughput and MFU (`stabledrl bench`) of a recipe on one 8-GPU node.
#
#   sbatch [--nodes=N] [--partition=P] [--account=A] slurm/bench_throughput.sh [KEY=VALUE ...]
#
# Submit from the repository root (or set STABLEDRL_ROOT). Environment, defaults:
#   STABLEDRL_CONFIG=examples/configs/llada_8b_stabledrl.yaml  STABLEDRL_OVERRIDES=""
#   STABLEDRL_RUN_DIR=<config logging.run_dir>  STABLEDRL_PYTHON=python  STABLEDRL_DEVICE=gpu
#   STABLEDRL_BENCH_JSON=<run_dir>/logs/<job>/restart_0/bench.json
#   MASTER_ADDR=<first node>  MASTER_PORT=<20000 + job id % 20000>   (details: slurm/common.sh)
#SBATCH --job-name=stabledrl-bench
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --time=01:00:00
#SBATCH --output=slurm-%x-%j.out

# shellcheck source=slurm/common.sh
source "${STABLEDRL_ROOT:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}/slurm/common.sh"
sdrl_bench "$STABLEDRL_ROOT/examples/configs/llada_8b_stabledrl.yaml" "$@"
