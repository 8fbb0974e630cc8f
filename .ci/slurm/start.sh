#!/usr/bin/env bash
# Start a two-node SLURM cluster on this host: its own munged, slurmctld, and slurmd for nodes n1, n2.
#
#   sudo bash .ci/slurm/start.sh             # then: export SLURM_CONF=/tmp/lightning_zero_slurm/etc/slurm.conf
#   sudo bash .ci/slurm/stop.sh              # tears it all down again (same LZ_SLURM_DIR)
#
# Needs root (the daemons run as root) and the packages of install.sh. Everything the cluster
# writes stays in one folder: configuration, MUNGE key and socket, state, pid and log files. No
# system file is touched (not /etc/munge, not /etc/hosts, not a munged already running), so
# several clusters can run side by side, each with its own folder and ports.
# Settings (environment):
#   LZ_SLURM_DIR         the cluster's folder (default /tmp/lightning_zero_slurm)
#   LZ_SLURM_CTLD_PORT   slurmctld's port (default: a free one)
#   LZ_SLURM_NODE_PORTS  slurmd ports of n1 and n2, two consecutive ones (default: a free pair, e.g. 41001-41002)
#   LZ_SLURM_CPUS        CPUs each node advertises (default 2; more than the host has is fine)
# The node names n1 and n2 do not resolve: jobs need MASTER_ADDR=127.0.0.1 in their environment
# (Lightning otherwise takes the first node name of SLURM_NODELIST as the rendezvous address).
# A stale cluster in the same folder is stopped first. If anything fails, everything started so
# far is stopped again and the exit status is non-zero.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
export PATH="$PATH:/usr/sbin:/sbin"
DIR="${LZ_SLURM_DIR:-/tmp/lightning_zero_slurm}"
export LZ_SLURM_DIR="$DIR"  # for stop.sh
CPUS="${LZ_SLURM_CPUS:-2}"
HOST="$(hostname -s)"
export SLURM_CONF="$DIR/etc/slurm.conf"
MUNGE_SOCKET="$DIR/run/munge.socket"

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

# Prints "CTLD_PORT FIRST_NODE_PORT": ports nothing listens on now, the node ports consecutive.
free_ports() {
    python3 - <<'EOF'
import socket

def bound(port=0):
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    return s

held = [bound()]  # slurmctld
while True:
    first = bound()
    try:
        second = bound(first.getsockname()[1] + 1)
    except OSError:
        first.close()
        continue
    held += [first, second]
    break
print(held[0].getsockname()[1], held[1].getsockname()[1])
for s in held:
    s.close()
EOF
}

start_munge() {
    mungekey --create --keyfile="$DIR/etc/munge.key"
    chmod 0400 "$DIR/etc/munge.key"
    # The daemons carry LZ_SLURM_CLUSTER in their environment: stop.sh finds them (and theirs) by it.
    LZ_SLURM_CLUSTER="$DIR" munged --socket="$MUNGE_SOCKET" --key-file="$DIR/etc/munge.key" \
        --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/run/munged.seed" ||
        fail "munged did not start"
    wait_for 10 bash -c "munge --socket='$MUNGE_SOCKET' -n | unmunge --socket='$MUNGE_SOCKET'" ||
        fail "munged does not answer on $MUNGE_SOCKET"
}

render_conf() {
    local first_job_id=$((1000 + RANDOM % 9000))  # Lightning's MASTER_PORT is 15000 + the job id's last 4 digits
    sed -e "s|@DIR@|$DIR|g" -e "s|@HOST@|$HOST|g" -e "s|@CTLD_PORT@|$CTLD_PORT|g" \
        -e "s|@NODE_PORTS@|$NODE_PORTS|g" -e "s|@CPUS@|$CPUS|g" -e "s|@MUNGE_SOCKET@|$MUNGE_SOCKET|g" \
        -e "s|@FIRST_JOB_ID@|$first_job_id|g" "$HERE/slurm.conf.in" >"$SLURM_CONF"
}

nodes_idle() {
    [[ "$(sinfo -h -N -o '%N %T' | sort -u | tr '\n' ' ')" == "n1 idle n2 idle " ]]
}

[[ "$(id -u)" == 0 ]] || { log "needs root (the daemons run as root)"; exit 3; }
[[ "$DIR" == /?*/?* ]] || { log "LZ_SLURM_DIR must be an absolute path below a folder, got '$DIR'"; exit 2; }
if [[ -z "${LZ_SLURM_CTLD_PORT:-}" || -z "${LZ_SLURM_NODE_PORTS:-}" ]]; then
    read -r free_ctld free_node < <(free_ports) || { log "cannot pick free ports (python3 is needed)"; exit 2; }
fi
CTLD_PORT="${LZ_SLURM_CTLD_PORT:-$free_ctld}"
NODE_PORTS="${LZ_SLURM_NODE_PORTS:-$free_node-$((free_node + 1))}"
bash "$HERE/stop.sh" >/dev/null 2>&1 || true
rm -rf "$DIR"/{etc,run,log,spool}
mkdir -p "$DIR"/{etc,run,log,spool/ctld,spool/n1,spool/n2}
chmod 0755 "$DIR" "$DIR/run"  # munged refuses a socket in a folder not everyone may enter
render_conf
start_munge
LZ_SLURM_CLUSTER="$DIR" slurmctld -f "$SLURM_CONF" || fail "slurmctld did not start"
wait_for 30 scontrol ping || fail "slurmctld does not answer scontrol ping"
LZ_SLURM_CLUSTER="$DIR" slurmd -f "$SLURM_CONF" -N n1 || fail "slurmd -N n1 did not start"
LZ_SLURM_CLUSTER="$DIR" slurmd -f "$SLURM_CONF" -N n2 || fail "slurmd -N n2 did not start"
wait_for 60 nodes_idle || fail "nodes n1, n2 are not idle: $(sinfo -h -N -o '%N %T' | tr '\n' ' ')"
log "cluster up: $(sinfo -h -o '%P %D %T %N'), slurmctld port $CTLD_PORT, slurmd ports $NODE_PORTS"
log "use it with: export SLURM_CONF=$SLURM_CONF MASTER_ADDR=127.0.0.1"
