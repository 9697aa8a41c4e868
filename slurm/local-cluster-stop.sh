#!/usr/bin/env bash
# Stop the local Slurm cluster started by slurm/local-cluster-start.sh (same MHPC_SLURM_DIR).
# Copes with half-started clusters and is a no-op when nothing runs. Order:
#   1. cancel all jobs and wait for them (job processes are not children of slurmd)
#   2. SIGTERM slurmd x N, slurmctld, slurmdbd and MariaDB, each by the PID in its pid file,
#      SIGKILL whatever is still alive after 30 s
#   3. SIGKILL leftover slurmstepd processes of this cluster (found by SLURM_CONF in their environment)
# Processes are only ever killed by PID, never by name.
# MHPC_SLURM_WIPE=1 also deletes the cluster directory's contents (config, state, logs, DB).
set -uo pipefail

DIR=${MHPC_SLURM_DIR:-/tmp/megatron-hpc-slurm}
export SLURM_CONF=$DIR/etc/slurm.conf

say() { echo "[local-slurm stop] $*"; }
alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

# pid_from FILE : print the PID in FILE if it still belongs to one of our daemons (not a reused PID)
pid_from() {
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    case "$(readlink "/proc/$pid/exe" 2>/dev/null)" in
        *slurm*|*mariadbd*|*mysqld*) echo "$pid" ;;
        *) return 1 ;;
    esac
}

cancel_jobs() {
    alive "$(pid_from "$DIR/run/slurmctld.pid")" && [ -e "$SLURM_CONF" ] || return 0
    local jobs
    jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
    [ -n "${jobs// /}" ] || return 0
    say "cancelling jobs: $jobs"
    scancel $jobs 2>/dev/null
    for _ in $(seq 100); do
        [ -z "$(squeue -h -t running,completing,suspended,configuring -o %i 2>/dev/null)" ] && return 0
        sleep 0.1
    done
    say "jobs still running after 10 s; stopping the daemons anyway"
}

# terminate SECONDS PIDFILE... : SIGTERM the daemons, wait up to SECONDS, then SIGKILL
terminate() {
    local secs=$1 f pid pids=""; shift
    for f in "$@"; do
        pid=$(pid_from "$f") && alive "$pid" && kill -TERM "$pid" 2>/dev/null && pids+=" $pid"
    done
    local deadline=$(( ${EPOCHREALTIME/./} + secs * 1000000 ))
    while (( ${EPOCHREALTIME/./} < deadline )); do
        local left=""
        for pid in $pids; do alive "$pid" && left+=" $pid"; done
        pids=$left
        [ -z "$pids" ] && break
        sleep 0.1
    done
    for pid in $pids; do
        say "pid $pid ignored SIGTERM, sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null
    done
    rm -f "$@"
}

kill_leftover_steps() {
    local p pid
    for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        case "$(readlink "$p/exe" 2>/dev/null)" in *slurmstepd*) ;; *) continue ;; esac
        if tr '\0' '\n' <"$p/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$SLURM_CONF"; then
            say "killing leftover slurmstepd $pid"
            kill -KILL "$pid" 2>/dev/null
        fi
    done
}

[ -d "$DIR" ] || { say "nothing to stop ($DIR does not exist)"; exit 0; }
cancel_jobs
# all daemons at once: the accounting DB is thrown away on the next start anyway
terminate 30 "$DIR"/run/slurmd-*.pid "$DIR"/run/{slurmctld,slurmdbd,mariadb}.pid
kill_leftover_steps
if [ "${MHPC_SLURM_WIPE:-0}" = 1 ]; then
    rm -rf "$DIR"/{etc,state,spool,log,run,db}
    say "wiped $DIR"
fi
say "stopped (cluster dir $DIR)"
