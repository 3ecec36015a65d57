#!/bin/bash
# sbatch with the repository and the job's files resolved now, at submit time, from anywhere:
#
#   slurm/submit.sh [SBATCH OPTIONS] JOB_SCRIPT [KEY=VALUE ...]
#   slurm/submit.sh --nodes=8 --partition=gpu train_llada_8b.sh algo.eps=0.1
#
# JOB_SCRIPT is a path, or a name in slurm/. sbatch runs a spooled copy of the job script, so
# the job cannot find the repository from its own path; this wrapper exports STABLEDRL_ROOT
# (this repository) and fails here, before anything is queued, with one line naming what is
# missing: the job script, STABLEDRL_CONFIG or STABLEDRL_ENV_SETUP (made absolute, as are
# STABLEDRL_RUN_DIR and a relative STABLEDRL_PYTHON path). A --signal=...@N among the sbatch
# options is passed on as STABLEDRL_SIGNAL_LEAD_S (plain sbatch does not tell the job).
# The job runs in the current directory, as with sbatch; everything else is sbatch's.
set -euo pipefail

die() { echo "slurm/submit.sh: error: $*" >&2; exit 2; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[[ -f "$ROOT/slurm/common.sh" ]] || die "$ROOT is not the stabledrl_mcore repository (no slurm/common.sh)"

options=() script="" rest=()
for arg in "$@"; do
    if [[ -n "$script" ]]; then
        rest+=("$arg")
    elif [[ "$arg" != -* && "$arg" == *.sh && ( -f "$arg" || -f "$ROOT/slurm/$arg" ) ]]; then
        if [[ -f "$arg" ]]; then script=$(realpath "$arg"); else script="$ROOT/slurm/$arg"; fi
    else
        options+=("$arg")
    fi
done
if [[ -z "$script" ]]; then
    die "name a job script (a file, or one of: $(cd "$ROOT/slurm" && ls -- *.sh | grep -v -x -e common.sh -e submit.sh |
        paste -s -d ' '))"
fi

absolute_file() {  # absolute_file VAR: VAR must name an existing file; made absolute
    local name=$1
    [[ -z "${!name:-}" ]] && return 0
    [[ -f "${!name}" ]] || die "$name=${!name} is not a file (relative paths are relative to $PWD)"
    export "$name=$(realpath "${!name}")"
}
absolute_file STABLEDRL_CONFIG
absolute_file STABLEDRL_ENV_SETUP
if [[ -n "${STABLEDRL_RUN_DIR:-}" ]]; then
    export STABLEDRL_RUN_DIR; STABLEDRL_RUN_DIR=$(realpath -m "$STABLEDRL_RUN_DIR")
fi
if [[ "${STABLEDRL_PYTHON:-}" == */* && "${STABLEDRL_PYTHON}" != /* ]]; then
    [[ -x "$STABLEDRL_PYTHON" ]] || die "STABLEDRL_PYTHON=$STABLEDRL_PYTHON is not an executable"
    export STABLEDRL_PYTHON; STABLEDRL_PYTHON=$(realpath "$STABLEDRL_PYTHON")
fi
[[ -z "${STABLEDRL_MOUNTS:-}" || -n "${STABLEDRL_CONTAINER:-}" ]] ||
    die "STABLEDRL_MOUNTS is set but STABLEDRL_CONTAINER is not"

signal="" previous=""
for arg in "${options[@]}"; do
    case "$arg" in
        --signal=*) signal=${arg#--signal=} ;;
        *) if [[ "$previous" == --signal ]]; then signal=$arg; fi ;;
    esac
    previous=$arg
done
if [[ -n "$signal" ]]; then
    signal=${signal##*:}
    if [[ "$signal" == *@* ]]; then STABLEDRL_SIGNAL_LEAD_S=${signal##*@}; else STABLEDRL_SIGNAL_LEAD_S=60; fi
    export STABLEDRL_SIGNAL_LEAD_S
fi

export STABLEDRL_ROOT="$ROOT"
exec sbatch "${options[@]}" "$script" "${rest[@]}"
