#!/usr/bin/env bash
# Tear down the cluster of start.sh: cancel its jobs, stop slurmd n1/n2 and slurmctld, end any
# job step left behind, stop the munged that start.sh started (not one that was already running)
# and undo start.sh's /etc/hosts line.
#
#   bash .ci/slurm/stop.sh      # same LZ_SLURM_DIR as start.sh; safe to run when nothing is up
#
# Only this cluster's processes are ended, each by its pid: the daemons (from their pid files, and
# by the LZ_SLURM_CLUSTER=<folder> that start.sh gives their environment), the job step daemons
# (slurmstepd with SLURM_CONF=<folder>/etc/slurm.conf), and every descendant of those: the tasks.
set -uo pipefail

export PATH="$PATH:/usr/sbin:/sbin"
DIR="${LZ_SLURM_DIR:-/tmp/lightning_zero_slurm}"
export SLURM_CONF="$DIR/etc/slurm.conf"
HOSTS_MARK="# lightning_zero emulated slurm nodes"

alive() { [[ -n "$1" ]] && kill -0 "$1" 2>/dev/null; }

pid_of() { [[ -s "$1" ]] && cat "$1"; }

environ_has() { { tr '\0' '\n' <"/proc/$1/environ"; } 2>/dev/null | grep -qxF "$2"; }

# This cluster's daemons and step daemons, and all their descendants, one pid a line.
cluster_pids() {
    local stat pid ppid rest comm
    local -A parent=() ours=()
    for stat in /proc/[0-9]*/stat; do
        pid="${stat#/proc/}"
        pid="${pid%/stat}"
        rest="$(cat "$stat" 2>/dev/null)" || continue
        comm="${rest#*(}"
        comm="${comm%)*}"
        read -r _ ppid _ <<<"${rest##*) }"
        parent[$pid]="$ppid"
        if environ_has "$pid" "LZ_SLURM_CLUSTER=$DIR" ||
            { [[ "$comm" == slurmstepd ]] && environ_has "$pid" "SLURM_CONF=$SLURM_CONF"; }; then
            ours[$pid]=1
        fi
    done
    local grown=1
    while ((grown)); do
        grown=0
        for pid in "${!parent[@]}"; do
            if [[ -z "${ours[$pid]:-}" && -n "${ours[${parent[$pid]}]:-}" ]]; then
                ours[$pid]=1
                grown=1
            fi
        done
    done
    unset "ours[$$]" "ours[$BASHPID]"
    printf '%s\n' "${!ours[@]}"
}

# Sends signal $1 to the given pids, waits up to 10 s for them, then SIGKILLs what is left.
end_pids() {
    local sig="$1" pid deadline
    shift
    (($#)) || return 0
    kill "-$sig" "$@" 2>/dev/null
    deadline=$((SECONDS + 10))
    for pid in "$@"; do
        while alive "$pid" && ((SECONDS < deadline)); do sleep 0.2; done
        alive "$pid" && kill -KILL "$pid" 2>/dev/null
    done
    return 0
}

# 1. Cancel the jobs while the daemons can still end them in order (SIGKILL first: no grace
#    period, and Lightning's SIGTERM handler would keep a task alive for KillWait seconds).
if [[ -f "$SLURM_CONF" ]] && scontrol ping >/dev/null 2>&1; then
    scancel --full --signal=KILL --quiet --partition=debug 2>/dev/null
    scancel --quiet --partition=debug 2>/dev/null
    for _ in $(seq 30); do
        [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break
        sleep 0.5
    done
fi

# 2. Whatever is left of this cluster, found before anything is ended (tasks lose their parent then).
mapfile -t leftovers < <(cluster_pids)
daemons=()
for f in "$DIR"/run/slurmd-n1.pid "$DIR"/run/slurmd-n2.pid "$DIR"/run/slurmctld.pid; do
    pid="$(pid_of "$f")"
    alive "$pid" && daemons+=("$pid")
done
end_pids TERM "${daemons[@]}"
end_pids KILL "${leftovers[@]}"

# 3. munged, if start.sh started it.
munged_pid="$(pid_of "$DIR/run/munged.pid")"
if alive "$munged_pid"; then
    end_pids TERM "$munged_pid"
fi
rm -f "$DIR/run/munged.pid"

# 4. The node names in /etc/hosts, if start.sh added them for this cluster.
if [[ -f "$DIR/run/hosts.added" ]] && grep -qF "$HOSTS_MARK" /etc/hosts 2>/dev/null; then
    # /etc/hosts may be a bind mount: rewrite it in place rather than replacing the file
    grep -vF "$HOSTS_MARK" /etc/hosts >"$DIR/hosts.tmp" && cat "$DIR/hosts.tmp" >/etc/hosts
    rm -f "$DIR/hosts.tmp"
fi
rm -f "$DIR/run/hosts.added"
exit 0
