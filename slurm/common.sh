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
#   STABLEDRL_ENV_SETUP  a bash file sourced before Python starts: in the batch shell (not
#                        with a container) and in every task (every node, every rank, inside
#                        the container if any), e.g. `module load ...`
#   STABLEDRL_CONTAINER  pyxis/enroot image: every srun gets --container-image=IMAGE,
#                        --container-mounts (STABLEDRL_MOUNTS, plus the repository, the
#                        working directory, the run directory and STABLEDRL_ENV_SETUP at
#                        their own paths) and --container-workdir=$PWD
#   STABLEDRL_MOUNTS     extra container mounts, SRC[:DST[:FLAGS]],... (needs STABLEDRL_CONTAINER)
#   STABLEDRL_SIGNAL_LEAD_S  seconds from the pre-emption signal to the kill   default: from
#                        SBATCH_SIGNAL or the job script's #SBATCH --signal (passed to the
#                        trainer as checkpoint.preemption_lead_s: it warns when a step plus
#                        twice the measured save time does not fit)
#   CUDA_DEVICE_MAX_CONNECTIONS, NCCL_*, TORCH_NCCL_*: defaults below, only where unset
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
# continues with --resume auto. Rank 0 holds <run_dir>/.lock for the whole run: a second job
# into the run directory is refused (by the config check, before srun) naming the holder, and a
# requeue whose earlier instance still holds it waits logging.lock_wait_s (default 300 s) first.

set -euo pipefail

STABLEDRL_ROOT=$(cd "${STABLEDRL_ROOT:-$(dirname "${BASH_SOURCE[0]}")/..}" && pwd)
STABLEDRL_PYTHON=${STABLEDRL_PYTHON:-python}
STABLEDRL_DEVICE=${STABLEDRL_DEVICE:-gpu}
EXIT_PREEMPTED=75   # stabledrl_mcore.rl.trainer.EXIT_PREEMPTED: checkpoint written, requeue me
SRUN_GRACE_S=${STABLEDRL_SRUN_GRACE_S:-60}  # srun --wait: end the other ranks this long after the first one exits
SDRL_MOUNT_PATHS=()  # more paths a job script's steps need inside a container (e.g. convert.sh's input)

sdrl_log() {
    printf '[stabledrl %(%F %T)T job=%s restart=%s] %s\n' -1 "${SLURM_JOB_ID:-none}" \
        "${SLURM_RESTART_COUNT:-0}" "$*" >&2
}

sdrl_die() { sdrl_log "error: $*"; exit 2; }

# What every task's shell runs before the command (as "$@"): STABLEDRL_ENV_SETUP, then exec.
# shellcheck disable=SC2016  # expanded by each task's shell, not here
SDRL_TASK_PRELUDE='if [[ -n "${STABLEDRL_ENV_SETUP:-}" ]]; then source "$STABLEDRL_ENV_SETUP" ||
  { echo "stabledrl: error: sourcing STABLEDRL_ENV_SETUP=$STABLEDRL_ENV_SETUP failed on $(hostname)" >&2; exit 2; }; fi
exec "$@"'

# CUDA/NCCL settings for multi-node training, each set only where unset, all printed.
SDRL_ENV_DEFAULTS=(
    CUDA_DEVICE_MAX_CONNECTIONS=1       # Megatron: TP/SP communication overlaps compute in order
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a failed collective ends the rank instead of hanging
    NCCL_IB_TIMEOUT=22                  # InfiniBand retry timeout (4.096 us * 2^22 ~ 17 s)
    NCCL_DEBUG=WARN                     # NCCL warnings reach the rank logs
)

# sdrl_env_setup: STABLEDRL_ENV_SETUP checked (and sourced here unless the ranks run in a
# container), then SDRL_ENV_DEFAULTS applied where unset; each setting is logged.
sdrl_env_setup() {
    if [[ -n "${STABLEDRL_ENV_SETUP:-}" ]]; then
        [[ -f "$STABLEDRL_ENV_SETUP" ]] || sdrl_die "STABLEDRL_ENV_SETUP=$STABLEDRL_ENV_SETUP is not a file"
        STABLEDRL_ENV_SETUP=$(realpath "$STABLEDRL_ENV_SETUP")
        export STABLEDRL_ENV_SETUP
        if [[ -z "${STABLEDRL_CONTAINER:-}" ]]; then
            set +u
            # shellcheck disable=SC1090  # the user's file
            source "$STABLEDRL_ENV_SETUP" || sdrl_die "sourcing STABLEDRL_ENV_SETUP=$STABLEDRL_ENV_SETUP failed"
            set -u
        fi
        sdrl_log "environment setup: $STABLEDRL_ENV_SETUP (sourced by every task before Python starts)"
    fi
    local entry name shown=()
    for entry in "${SDRL_ENV_DEFAULTS[@]}"; do
        name=${entry%%=*}
        if [[ -n "${!name+set}" ]]; then
            shown+=("$name=${!name} (yours)")
        else
            export "$entry"
            shown+=("$entry (default)")
        fi
    done
    sdrl_log "environment: ${shown[*]}"
}

# sdrl_srun_args [PATH ...]: SRUN_ARGS, the srun options every step gets: --cpus-per-task
# (srun >= 22.05 no longer inherits sbatch's) and the container options: STABLEDRL_MOUNTS, then
# the repository, $PWD, STABLEDRL_ENV_SETUP and the given paths, each at its own path.
sdrl_srun_args() {
    SRUN_ARGS=()
    if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then SRUN_ARGS+=(--cpus-per-task="$SLURM_CPUS_PER_TASK"); fi
    if [[ -z "${STABLEDRL_CONTAINER:-}" ]]; then
        [[ -z "${STABLEDRL_MOUNTS:-}" ]] || sdrl_die "STABLEDRL_MOUNTS is set but STABLEDRL_CONTAINER is not"
        return 0
    fi
    local mounts=() path mount seen
    if [[ -n "${STABLEDRL_MOUNTS:-}" ]]; then IFS=, read -r -a mounts <<<"$STABLEDRL_MOUNTS"; fi
    for path in "$STABLEDRL_ROOT" "$PWD" ${STABLEDRL_ENV_SETUP:+"$STABLEDRL_ENV_SETUP"} "$@"; do
        [[ -n "$path" ]] || continue
        seen=""
        for mount in "${mounts[@]}"; do
            mount=${mount%%:*}
            if [[ "$path" == "$mount" || "$path" == "$mount"/* ]]; then seen=1; fi
        done
        if [[ -z "$seen" ]]; then mounts+=("$path:$path"); fi
    done
    SRUN_ARGS+=(--container-image="$STABLEDRL_CONTAINER" --container-mounts="$(IFS=,; echo "${mounts[*]}")"
                --container-workdir="$PWD")
}

# sdrl_python ARGS...: STABLEDRL_PYTHON ARGS where the ranks run it: in the container (one
# task on the first node) when STABLEDRL_CONTAINER is set, else here; stdout is the caller's.
sdrl_python() {
    if [[ -z "${STABLEDRL_CONTAINER:-}" ]]; then
        "$STABLEDRL_PYTHON" "$@"
        return
    fi
    sdrl_srun_args
    srun --nodes=1 --ntasks=1 "${SRUN_ARGS[@]}" bash -c "$SDRL_TASK_PRELUDE" task "$STABLEDRL_PYTHON" "$@"
}

# sdrl_signal_lead: SIGNAL_LEAD_S, the seconds between SLURM's pre-emption signal and the end
# of the job: STABLEDRL_SIGNAL_LEAD_S, else SBATCH_SIGNAL, else the job script's
# `#SBATCH --signal=[B:]SIG[@SECONDS]` (slurm/submit.sh passes a --signal given on the command
# line as STABLEDRL_SIGNAL_LEAD_S; plain sbatch does not expose it). Empty when unknown.
sdrl_signal_lead() {
    local spec=${SBATCH_SIGNAL:-} source=SBATCH_SIGNAL script=${BASH_SOURCE[-1]}
    SIGNAL_LEAD_S=${STABLEDRL_SIGNAL_LEAD_S:-}
    if [[ -n "$SIGNAL_LEAD_S" ]]; then
        source=STABLEDRL_SIGNAL_LEAD_S
    elif [[ -z "$spec" && -r "$script" ]]; then
        spec=$(sed -n 's/^#SBATCH[[:space:]]\{1,\}--signal[= ]\([^[:space:]]*\).*/\1/p' "$script" | head -n 1)
        source="the job script's #SBATCH --signal"
    fi
    if [[ -z "$SIGNAL_LEAD_S" && -n "$spec" ]]; then
        spec=${spec##*:}
        if [[ "$spec" == *@* ]]; then SIGNAL_LEAD_S=${spec##*@}; else SIGNAL_LEAD_S=60; fi  # sbatch's default
    fi
    if [[ -n "$SIGNAL_LEAD_S" && ! "$SIGNAL_LEAD_S" =~ ^[0-9]+$ ]]; then
        sdrl_die "pre-emption lead time '$SIGNAL_LEAD_S' (from $source) is not a number of seconds"
    fi
    if [[ -n "$SIGNAL_LEAD_S" ]]; then
        sdrl_log "pre-emption lead time ${SIGNAL_LEAD_S} s (from $source); the trainer warns if a step plus" \
            "twice the measured checkpoint time does not fit (<run_dir>/checkpoint_timing.json)"
    fi
}

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
    sdrl_env_setup
    local extra=()
    read -r -a extra <<<"${STABLEDRL_OVERRIDES:-}"
    OVERRIDES=("${extra[@]}" "$@")
    if [[ -n "${STABLEDRL_RUN_DIR:-}" ]]; then OVERRIDES+=("logging.run_dir=$STABLEDRL_RUN_DIR"); fi
    sdrl_log "nodes=${hosts[*]} tasks=${SLURM_NTASKS:-?} master=$MASTER_ADDR:${MASTER_PORT:-<from job id>}" \
        "device=$STABLEDRL_DEVICE restart_count=${SLURM_RESTART_COUNT:-0}"
}

# Validate CONFIG + OVERRIDES once, before any rank starts (also: no other run holds the run
# directory's lock; a requeue waits logging.lock_wait_s for its earlier instance); sets RUN_DIR
# and LOG_DIR and records the resolved config in LOG_DIR.
sdrl_resolve_config() {
    local resolved world=()
    # the job's ranks, counted here: in a container the check is one srun task (SLURM_NTASKS=1 there)
    if [[ -n "${SLURM_NTASKS:-}" ]]; then world=(--nproc "$SLURM_NTASKS"); fi
    # --resume auto as the ranks will run: a requeue's resume plan is checked here too
    resolved=$(sdrl_python -m stabledrl_mcore.cli train --config "$CONFIG" "${OVERRIDES[@]}" \
        --resume auto --print-config "${world[@]}") ||
        sdrl_die "preflight of $CONFIG ${OVERRIDES[*]} failed (the line above says why)"
    # logging.run_dir from the YAML (here: no Python outside a container); yaml.safe_dump quotes
    # a path with special characters in single quotes, doubling a quote inside
    RUN_DIR=$(awk '/^logging:/ {inside = 1; next} /^[^ ]/ {inside = 0}
                   inside && /^  run_dir: / {sub(/^  run_dir: /, ""); print; exit}' <<<"$resolved")
    if [[ "$RUN_DIR" == \'*\' ]]; then RUN_DIR=${RUN_DIR:1:-1}; RUN_DIR=${RUN_DIR//\'\'/\'}; fi
    [[ -n "$RUN_DIR" ]] || sdrl_die "no logging.run_dir in the resolved config of $CONFIG"
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
    header+=' host=$(hostname) restart=${SLURM_RESTART_COUNT:-0} start=$(date -Is)]"'
    sdrl_srun_args "${RUN_DIR:-}" "${SDRL_MOUNT_PATHS[@]}"
    local cmd=(srun --wait="$SRUN_GRACE_S" --output="$LOG_DIR/rank_%t.log" "${SRUN_ARGS[@]}"
               bash -c "$header"$'\n'"$SDRL_TASK_PRELUDE" rank "$@")
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

# sdrl_marker_here NAME: <run_dir>/NAME (PREEMPTED or FINISHED) is this attempt's (rank 0 writes the
# job id and restart count into it: stabledrl_mcore.engine.preemption.marker_record), not an
# earlier one's.
sdrl_marker_here() {
    local marker="$RUN_DIR/$1"
    [[ -f "$marker" ]] && grep -Eq "\"slurm_job_id\": *\"$SLURM_JOB_ID\"" "$marker" &&
        grep -Eq "\"slurm_restart_count\": *\"${SLURM_RESTART_COUNT:-0}\"" "$marker"
}

# sdrl_train DEFAULT_CONFIG [KEY=VALUE ...]: StableDRL training with pre-emption and requeue.
sdrl_train() {
    CONFIG=${STABLEDRL_CONFIG:-$1}
    shift
    sdrl_setup "$@"
    sdrl_signal_lead
    if [[ -n "$SIGNAL_LEAD_S" ]]; then  # first: an override of the user's own wins
        OVERRIDES=("checkpoint.preemption_lead_s=$SIGNAL_LEAD_S" "${OVERRIDES[@]}")
    fi
    sdrl_resolve_config
    local rc=0
    # An earlier PREEMPTED is not removed here: until rank 0 holds the run directory's lock it may
    # be another run's (rank 0 removes it then). Only this attempt's marker counts (below).
    sdrl_run_step "$STABLEDRL_PYTHON" -m stabledrl_mcore.cli train --config "$CONFIG" \
        "${OVERRIDES[@]}" --resume auto || rc=$?
    if ((rc == 0)) && ! sdrl_marker_here FINISHED; then
        # every rank exited 0, but rank 0 never recorded the loop's end: os._exit(0) in user code
        sdrl_log "error: srun exited 0, but $RUN_DIR/FINISHED of this attempt is missing: the ranks" \
            "exited without finishing the run (os._exit(0) in user code, e.g. rollout.reward_fn?); status 1"
        rc=1
    fi
    if ((rc != 0 && rc != EXIT_PREEMPTED)) && sdrl_marker_here PREEMPTED; then
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
