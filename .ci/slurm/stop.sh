#!/usr/bin/env bash
# Tear down the cluster of start.sh: cancel its jobs, stop slurmd n1/n2 and slurmctld, end any
# job step left behind, and stop the cluster's own munged.
#
#   sudo bash .ci/slurm/stop.sh   # same LZ_SLURM_DIR as start.sh; safe to run when nothing is up
#
# Only this cluster's processes are ended, each by its pid: the daemons (from their pid files, and
# by the LZ_SLURM_CLUSTER=<folder> that start.sh gives their environment), the job step daemons
# (slurmstepd with SLURM_CONF=<folder>/etc/slurm.conf), and every descendant of those: the tasks.
# Other clusters, in other folders, keep running. The folder itself stays (its logs); remove it
# when done.
set -uo pipefail

export PATH="$PATH:/usr/sbin:/sbin"
DIR="${LZ_SLURM_DIR:-/tmp/lightning_zero_slurm}"
export SLURM_CONF="$DIR/etc/slurm.conf"

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

# 2. Whatever is left of this cluster, found before anything is ended (tasks lose their parent then),
#    except munged (step 3).
munged_pid="$(pid_of "$DIR/run/munged.pid")"
mapfile -t leftovers < <(cluster_pids | grep -vxF "${munged_pid:-none}")
daemons=()
for f in "$DIR"/run/slurmd-n1.pid "$DIR"/run/slurmd-n2.pid "$DIR"/run/slurmctld.pid; do
    pid="$(pid_of "$f")"
    alive "$pid" && daemons+=("$pid")
done
end_pids TERM "${daemons[@]}"
end_pids KILL "${leftovers[@]}"

# 3. The cluster's munged, last: the daemons authenticate with it while they shut down.
alive "$munged_pid" && end_pids TERM "$munged_pid"
exit 0
