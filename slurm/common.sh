# shellcheck shell=bash
# The one launcher behind every job script in slurm/ (sourced, never submitted).
#
# A job script holds only its #SBATCH header and one call: sdrl_train, sdrl_bench
# or sdrl_run_step. Everything else comes from $SLURM_*, the config file, or
# these environment variables (sbatch exports the submitting shell's environment):
#
#   STABLEDRL_ROOT       repository root                 default: the directory above this file
#   STABLEDRL_CONFIG     run config (YAML)               default: the job script's recipe
#   STABLEDRL_OVERRIDES  extra dotted overrides, space-separated   default: none
#                        (arguments after the script name are overrides too:
#                         sbatch slurm/train_llada_8b.sh algo.eps=0.1)
#   STABLEDRL_RUN_DIR    run directory (logging.run_dir) default: the config's logging.run_dir
#   STABLEDRL_PYTHON     interpreter for every rank      default: python
#   STABLEDRL_DEVICE     gpu | cpu                       default: gpu
#                        (cpu hides GPUs from the ranks: gloo, no GPU binding; submit
#                         with --gpus-per-node=0 when the cluster has no GPUs)
#   MASTER_ADDR          rendezvous host                 default: NodeAddr of the job's first node
#   MASTER_PORT          rendezvous port                 default: 20000 + SLURM_JOB_ID % 20000
#                                                        (derived by stabledrl_mcore.parallel.bootstrap)
#
# Each rank is one srun task: SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID give its
# rank/world size/local rank. Logs of job J, attempt R (SLURM_RESTART_COUNT) go to
#   <run_dir>/logs/J/restart_R/{command.txt,config.yaml,rank_<task>.log}
# Pre-emption: the batch shell traps USR1 (sent by --signal=B:USR1@secs before the
# time limit, or `scancel -b -s USR1 J`) and TERM, forwards them to srun (and srun to
# every rank); ranks finish the step, checkpoint and exit 75 (rank 0 also leaves
# <run_dir>/PREEMPTED); on USR1 the job then requeues itself and the next attempt
# continues with --resume auto.

set -euo pipefail

STABLEDRL_ROOT=${STABLEDRL_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
STABLEDRL_PYTHON=${STABLEDRL_PYTHON:-python}
STABLEDRL_DEVICE=${STABLEDRL_DEVICE:-gpu}
EXIT_PREEMPTED=75   # stabledrl_mcore.rl.trainer.EXIT_PREEMPTED: checkpoint written, requeue me
SRUN_GRACE_S=${STABLEDRL_SRUN_GRACE_S:-60}  # srun --wait: end the other ranks this long after the first one exits

sdrl_log() {
    printf '[stabledrl %(%F %T)T job=%s restart=%s] %s\n' -1 "${SLURM_JOB_ID:-none}" \
        "${SLURM_RESTART_COUNT:-0}" "$*" >&2
}

sdrl_die() { sdrl_log "error: $*"; exit 2; }

# Rendezvous and device settings shared by every rank; sets OVERRIDES from
# STABLEDRL_OVERRIDES, the given arguments and STABLEDRL_RUN_DIR.
sdrl_setup() {
    [[ -n "${SLURM_JOB_ID:-}" ]] || sdrl_die "submit me with sbatch (SLURM_JOB_ID is not set)"
    local hosts=()
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    if [[ -z "${MASTER_ADDR:-}" ]]; then
        MASTER_ADDR=$(scontrol show node "${hosts[0]}" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
        export MASTER_ADDR=${MASTER_ADDR:-${hosts[0]}}
    fi
    case "$STABLEDRL_DEVICE" in
        gpu) ;;
        cpu) export CUDA_VISIBLE_DEVICES="" ;;
        *) sdrl_die "STABLEDRL_DEVICE must be gpu or cpu, not '$STABLEDRL_DEVICE'" ;;
    esac
    export PYTHONPATH="$STABLEDRL_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    local extra=()
    read -r -a extra <<<"${STABLEDRL_OVERRIDES:-}"
    OVERRIDES=("${extra[@]}" "$@")
    if [[ -n "${STABLEDRL_RUN_DIR:-}" ]]; then OVERRIDES+=("logging.run_dir=$STABLEDRL_RUN_DIR"); fi
    sdrl_log "nodes=${hosts[*]} tasks=${SLURM_NTASKS:-?} master=$MASTER_ADDR:${MASTER_PORT:-<from job id>}" \
        "device=$STABLEDRL_DEVICE restart_count=${SLURM_RESTART_COUNT:-0}"
}

# Validate CONFIG + OVERRIDES once, before any rank starts; sets RUN_DIR and LOG_DIR
# and records the resolved config in LOG_DIR.
sdrl_resolve_config() {
    local resolved
    # --resume auto as the ranks will run: a requeue's resume plan is checked here too
    resolved=$("$STABLEDRL_PYTHON" -m stabledrl_mcore.cli train --config "$CONFIG" "${OVERRIDES[@]}" \
        --resume auto --print-config) || sdrl_die "invalid config $CONFIG ${OVERRIDES[*]}"
    RUN_DIR=$("$STABLEDRL_PYTHON" -c 'import sys, yaml; print(yaml.safe_load(sys.stdin)["logging"]["run_dir"])' \
        <<<"$resolved")
    sdrl_log_dir "$RUN_DIR"
    printf '%s\n' "$resolved" >"$LOG_DIR/config.yaml"
}

sdrl_log_dir() {  # sdrl_log_dir RUN_DIR: sets RUN_DIR (absolute) and LOG_DIR
    RUN_DIR=$(realpath -m "$1")
    LOG_DIR="$RUN_DIR/logs/$SLURM_JOB_ID/restart_${SLURM_RESTART_COUNT:-0}"
    mkdir -p "$LOG_DIR"
    sdrl_log "run dir $RUN_DIR; logs in $LOG_DIR"
}

_sdrl_forward() {  # trap handler: remember the signal and pass it on to srun
    CAUGHT_SIGNAL=$1
    sdrl_log "caught SIG$1; forwarding it to srun (pid ${SRUN_PID:-not started})"
    if [[ -n "${SRUN_PID:-}" ]]; then kill -s "$1" "$SRUN_PID" 2>/dev/null || true; fi
}

# sdrl_run_step CMD...: run CMD as one srun task per rank (per-rank logs in LOG_DIR,
# USR1/TERM forwarded); records the exact command; returns srun's exit status.
sdrl_run_step() {
    # shellcheck disable=SC2016  # expanded by each task's shell, not here
    local header='echo "[rank $SLURM_PROCID/$SLURM_NTASKS local=$SLURM_LOCALID node=$SLURMD_NODENAME'
    # shellcheck disable=SC2016
    header+=' host=$(hostname) restart=${SLURM_RESTART_COUNT:-0} start=$(date -Is)]"; exec "$@"'
    local cmd=(srun --wait="$SRUN_GRACE_S" --output="$LOG_DIR/rank_%t.log" bash -c "$header" rank "$@")
    {
        printf '# job %s restart %s nodes %s tasks %s master %s:%s device %s\n' "$SLURM_JOB_ID" \
            "${SLURM_RESTART_COUNT:-0}" "$SLURM_JOB_NODELIST" "${SLURM_NTASKS:-?}" "$MASTER_ADDR" \
            "${MASTER_PORT:-<from job id>}" "$STABLEDRL_DEVICE"
        printf '%q ' "${cmd[@]}"
        printf '\n'
    } >"$LOG_DIR/command.txt"
    sdrl_log "running: $*"
    CAUGHT_SIGNAL=""
    trap '_sdrl_forward USR1' USR1
    trap '_sdrl_forward TERM' TERM
    "${cmd[@]}" &
    SRUN_PID=$!
    local rc=0 again
    # A trapped signal interrupts `wait` (status > 128); keep waiting until srun is gone,
    # then collect its real status if the last wait was such an interruption.
    while :; do
        rc=0; wait "$SRUN_PID" || rc=$?
        kill -0 "$SRUN_PID" 2>/dev/null || break
    done
    if ((rc > 128)); then
        again=0; wait "$SRUN_PID" || again=$?
        if ((again != 127)); then rc=$again; fi
    fi
    SRUN_PID=""
    sdrl_log "srun exited with status $rc"
    return "$rc"
}

# sdrl_train DEFAULT_CONFIG [KEY=VALUE ...]: StableDRL training with pre-emption and requeue.
sdrl_train() {
    CONFIG=${STABLEDRL_CONFIG:-$1}
    shift
    sdrl_setup "$@"
    sdrl_resolve_config
    local rc=0
    rm -f "$RUN_DIR/PREEMPTED"  # rank 0 writes it after a pre-emption checkpoint (see below)
    sdrl_run_step "$STABLEDRL_PYTHON" -m stabledrl_mcore.cli train --config "$CONFIG" \
        "${OVERRIDES[@]}" --resume auto || rc=$?
    if ((rc != 0 && rc != EXIT_PREEMPTED)) && [[ -f "$RUN_DIR/PREEMPTED" ]]; then
        # the checkpoint was written, but a rank did not exit 75 in time (srun --wait ended it)
        sdrl_log "status $rc, but $RUN_DIR/PREEMPTED says the ranks checkpointed: treating it as $EXIT_PREEMPTED"
        rc=$EXIT_PREEMPTED
    fi
    if ((rc == EXIT_PREEMPTED)) && [[ "$CAUGHT_SIGNAL" != TERM ]]; then
        # TERM means SLURM itself is ending the job (scancel, time limit): do not requeue.
        sdrl_log "ranks checkpointed and exited $rc: requeueing job $SLURM_JOB_ID (--resume auto)"
        scontrol requeue "$SLURM_JOB_ID" ||
            sdrl_log "scontrol requeue failed; resubmit with STABLEDRL_RUN_DIR=$RUN_DIR to resume"
    fi
    exit "$rc"
}

# sdrl_bench DEFAULT_CONFIG [KEY=VALUE ...]: per-phase throughput, JSON in
# STABLEDRL_BENCH_JSON (default <run_dir>/logs/<job>/restart_<n>/bench.json).
sdrl_bench() {
    CONFIG=${STABLEDRL_CONFIG:-$1}
    shift
    sdrl_setup "$@"
    sdrl_resolve_config
    local json=${STABLEDRL_BENCH_JSON:-$LOG_DIR/bench.json}
    sdrl_run_step "$STABLEDRL_PYTHON" -m stabledrl_mcore.cli bench --config "$CONFIG" \
        "${OVERRIDES[@]}" --json "$json"
}
