#!/usr/bin/env bash
# Install SLURM and MUNGE from Debian's packages, if they are not there yet.
#
#   sudo bash .ci/slurm/install.sh   # idempotent: exits at once when everything is installed
#
# Installs slurm-wlm (slurmctld + slurmd + slurm-client, with their plugins) and munge; apt-get
# also creates /etc/munge/munge.key (the clusters of start.sh use keys of their own). The
# packages' own init scripts are not used: .ci/slurm/start.sh runs the daemons itself.
# The test suite runs this only with LZ_SLURM=install (CI: .ci/run), never by default.
# Exit status 3 means "cannot install here" (no apt-get, not root).
set -euo pipefail

NEEDED=(slurmctld slurmd sbatch srun scontrol munged mungekey)

missing() {
    local tool
    for tool in "${NEEDED[@]}"; do
        command -v "$tool" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin" command -v "$tool" >/dev/null 2>&1 || {
            echo "$tool"
            return
        }
    done
}

if [[ -z "$(missing)" ]]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install.sh: $(missing) is missing and there is no apt-get to install slurm-wlm and munge" >&2
    exit 3
fi
if [[ "$(id -u)" != 0 ]]; then
    echo "install.sh: $(missing) is missing; installing slurm-wlm and munge needs root (run: sudo $0)" >&2
    exit 3
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
if [[ -n "$(missing)" ]]; then
    echo "install.sh: installed slurm-wlm and munge, but $(missing) is still not on PATH" >&2
    exit 1
fi
echo "install.sh: slurm-wlm and munge installed ($(PATH="$PATH:/usr/sbin" slurmctld -V))"
