#!/usr/bin/env bash
# Start a two-node SLURM cluster on this host: munged, slurmctld, and slurmd for nodes n1 and n2.
#
#   bash .ci/slurm/start.sh                  # then: export SLURM_CONF=/tmp/lightning_zero_slurm/etc/slurm.conf
#   bash .ci/slurm/stop.sh                   # tears it all down again
#
# Needs root (the daemons run as root, munged as user munge) and the packages of install.sh.
# Settings (environment):
#   LZ_SLURM_DIR         folder for the config, state, pid and log files (default /tmp/lightning_zero_slurm)
#   LZ_SLURM_CTLD_PORT   slurmctld's port (default 16817)
#   LZ_SLURM_NODE_PORTS  slurmd ports of n1 and n2 (default 17001-17002)
#   LZ_SLURM_CPUS        CPUs each node advertises (default 2; more than the host has is fine)
# A stale cluster in the same folder is stopped first. If anything fails, everything started so
# far is stopped again and the exit status is non-zero.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
export PATH="$PATH:/usr/sbin:/sbin"
DIR="${LZ_SLURM_DIR:-/tmp/lightning_zero_slurm}"
export LZ_SLURM_DIR="$DIR"  # for stop.sh
CTLD_PORT="${LZ_SLURM_CTLD_PORT:-16817}"
NODE_PORTS="${LZ_SLURM_NODE_PORTS:-17001-17002}"
CPUS="${LZ_SLURM_CPUS:-2}"
HOST="$(hostname -s)"
export SLURM_CONF="$DIR/etc/slurm.conf"
HOSTS_MARK="# lightning_zero emulated slurm nodes"

log() { echo "start.sh: $*" >&2; }

fail() {
    log "$*"
    for f in "$DIR"/log/*.log; do
        [[ -f "$f" ]] && { echo "--- $f (last lines)" >&2; tail -n 15 "$f" >&2; }
    done
    bash "$HERE/stop.sh" >&2 || true
    exit 1
}

# Waits up to $1 seconds for the command after it to succeed.
wait_for() {
    local deadline=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        log "munged is already running; using it"
        return
    fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        mungekey --create --keyfile=/etc/munge/munge.key
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 0755 /run/munge
    runuser -u munge -- munged
    wait_for 10 bash -c 'munge -n | unmunge' || fail "munged did not come up"
    cp /run/munge/munged.pid "$DIR/run/munged.pid"  # stop.sh stops only a munged this script started
}

add_hosts() {
    # Lightning takes MASTER_ADDR from the first name in SLURM_NODELIST, so n1 must resolve.
    if getent hosts n1 >/dev/null && getent hosts n2 >/dev/null; then
        return
    fi
    echo "127.0.0.1 n1 n2 $HOSTS_MARK" >>/etc/hosts
    touch "$DIR/run/hosts.added"  # stop.sh removes the line only then
}

render_conf() {
    sed -e "s|@DIR@|$DIR|g" -e "s|@HOST@|$HOST|g" -e "s|@CTLD_PORT@|$CTLD_PORT|g" \
        -e "s|@NODE_PORTS@|$NODE_PORTS|g" -e "s|@CPUS@|$CPUS|g" "$HERE/slurm.conf.in" >"$SLURM_CONF"
}

nodes_idle() {
    [[ "$(sinfo -h -N -o '%N %T' | sort -u | tr '\n' ' ')" == "n1 idle n2 idle " ]]
}

[[ "$(id -u)" == 0 ]] || { log "needs root (the daemons run as root, munged as user munge)"; exit 3; }
[[ "$DIR" == /?*/?* ]] || { log "LZ_SLURM_DIR must be an absolute path below a folder, got '$DIR'"; exit 2; }
bash "$HERE/stop.sh" >/dev/null 2>&1 || true
rm -rf "$DIR"/{etc,run,log,spool}
mkdir -p "$DIR"/{etc,run,log,spool/ctld,spool/n1,spool/n2}
render_conf
start_munge
add_hosts
# The daemons carry LZ_SLURM_CLUSTER in their environment: stop.sh finds them (and theirs) by it.
LZ_SLURM_CLUSTER="$DIR" slurmctld -f "$SLURM_CONF" || fail "slurmctld did not start"
wait_for 30 scontrol ping || fail "slurmctld does not answer scontrol ping"
LZ_SLURM_CLUSTER="$DIR" slurmd -f "$SLURM_CONF" -N n1 || fail "slurmd -N n1 did not start"
LZ_SLURM_CLUSTER="$DIR" slurmd -f "$SLURM_CONF" -N n2 || fail "slurmd -N n2 did not start"
wait_for 60 nodes_idle || fail "nodes n1, n2 are not idle: $(sinfo -h -N -o '%N %T' | tr '\n' ' ')"
log "cluster up: $(sinfo -h -o '%P %D %T %N'), SLURM_CONF=$SLURM_CONF"
