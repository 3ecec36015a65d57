#!/usr/bin/env bash
# Make sure SLURM (slurm-wlm) and munge are installed, for the local-cluster tests.
#
# Exit 0: sbatch, slurmctld, slurmd and munged are on PATH (installed now if needed).
# Exit 1: they are missing and cannot be installed here; the reason is printed.
# Installs only Debian's own packages (apt-get install slurm-wlm munge), only as root.
set -euo pipefail

have_all() {
    local tool
    for tool in sbatch srun scontrol slurmctld slurmd munged; do
        command -v "$tool" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null 2>&1 || return 1
    done
}

if have_all; then
    exit 0
fi
if [[ "$(id -u)" -ne 0 ]]; then
    echo "ensure_slurm: SLURM/munge are not installed and we are not root (cannot apt-get install slurm-wlm munge)" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_slurm: SLURM/munge are not installed and apt-get is not available on this system" >&2
    exit 1
fi
echo "ensure_slurm: installing slurm-wlm and munge with apt-get" >&2
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null; then
    apt-get update -q >/dev/null || { echo "ensure_slurm: apt-get update failed" >&2; exit 1; }
    apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null \
        || { echo "ensure_slurm: apt-get install slurm-wlm munge failed" >&2; exit 1; }
fi
have_all || { echo "ensure_slurm: slurm-wlm installed but its commands are not on PATH" >&2; exit 1; }
echo "ensure_slurm: slurm-wlm $(dpkg-query -W -f='${Version}' slurm-wlm 2>/dev/null) and munge installed" >&2
