#!/usr/bin/env bash
# Start a throw-away Slurm 22.05 cluster on this one machine (Debian 12, root, no systemd).
#
#   slurmctld  + one slurmd per simulated node (node1..nodeN, each in its own UTS namespace so
#   `hostname` inside a job prints the node name) + slurmdbd and a private MariaDB (so sacct works).
#   No munge: AuthType=auth/none (still available in 22.05, removed in >= 23.11).
#   With accounting, sbatch checks --account and --qos against slurmdbd (AccountingStorageEnforce=
#   associations,qos): root may use its default account `root` and the test account `mhpc-test`, with
#   the QOS `normal` and `mhpc-high`; anything else is refused as on a real site. Nodes carry the
#   features `cpu` and `rackK` (node1-2: rack1, node3-4: rack2, ...) for --constraint.
#
# Usage:   bash slurm/local-cluster-start.sh && export SLURM_CONF=$MHPC_SLURM_DIR/etc/slurm.conf
# Stop:    bash slurm/local-cluster-stop.sh
# Knobs (environment):
#   MHPC_SLURM_DIR=/tmp/megatron-hpc-slurm  state, logs, pid files, DB, generated config
#   MHPC_SLURM_NODES=4                      number of simulated nodes
#   MHPC_SLURM_CPUS=4                       CPUs per node (may exceed the real core count)
#   MHPC_SLURM_ACCOUNTING=1                 1: slurmdbd + MariaDB (sacct); 0: no accounting
#   MHPC_SLURM_INSTALL=1                    1: apt-get install missing packages
#   MHPC_SLURM_EXTRA_CONF=                  extra slurm.conf lines (appended before the node lines)
# Ports: 6817 slurmctld, 6819 slurmdbd, 3307 MariaDB, 17001.. slurmd (one per node).
# Prints `export SLURM_CONF=...` as its last line. Exit status 0 means all nodes are idle.
set -euo pipefail

DIR=${MHPC_SLURM_DIR:-/tmp/megatron-hpc-slurm}
NODES=${MHPC_SLURM_NODES:-4}
CPUS=${MHPC_SLURM_CPUS:-4}
ACCOUNTING=${MHPC_SLURM_ACCOUNTING:-1}
INSTALL=${MHPC_SLURM_INSTALL:-1}
EXTRA_CONF=${MHPC_SLURM_EXTRA_CONF:-}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export SLURM_CONF=$DIR/etc/slurm.conf
DB_PASS=mhpc-local
T0=${EPOCHREALTIME/./}

say() { local us=$(( ${EPOCHREALTIME/./} - T0 )); printf '[local-slurm %3d.%01ds] %s\n' $((us / 1000000)) $((us / 100000 % 10)) "$*"; }
die() { echo "local-cluster-start: ERROR: $*" >&2; echo "logs: $DIR/log; clean up with: bash $HERE/local-cluster-stop.sh" >&2; exit 1; }
nodes() { seq -f 'node%g' 1 "$NODES"; }

# wait_until SECONDS CMD... : poll CMD every 0.1 s; status 1 on timeout
wait_until() {
    local deadline=$(( ${EPOCHREALTIME/./} + $1 * 1000000 )); shift
    until "$@" >/dev/null 2>&1; do
        (( ${EPOCHREALTIME/./} < deadline )) || return 1
        sleep 0.1
    done
}
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

check_args() {
    [ "$(id -u)" = 0 ] || die "must run as root (daemons run as root, /etc/hosts is edited)"
    [[ $NODES =~ ^[1-9][0-9]?$ ]] || die "MHPC_SLURM_NODES must be 1..99, got '$NODES'"
    [[ $CPUS =~ ^[1-9][0-9]*$ ]] || die "MHPC_SLURM_CPUS must be a positive integer, got '$CPUS'"
}

install_packages() {
    [ "$INSTALL" = 1 ] || return 0
    local pkgs="slurmctld slurmd slurm-client" missing="" p
    [ "$ACCOUNTING" = 1 ] && pkgs+=" slurmdbd mariadb-server"
    for p in $pkgs; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=" $p"
    done
    [ -n "$missing" ] || return 0
    say "installing:$missing"
    # policy-rc.d exit 101 keeps the packages' maintainer scripts from starting their services
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
    fi
    local aptlog=${TMPDIR:-/tmp}/megatron-hpc-slurm-apt.log
    # apt's own locks fail at once when another install holds them (the test suite installs kubectl beside
    # this): both take /tmp/megatron-hpc-apt.lock first, and wait for each other.
    { flock 9; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends $missing; } 9>/tmp/megatron-hpc-apt.lock >"$aptlog" 2>&1 \
        || { tail -n 30 "$aptlog" >&2; die "apt-get failed"; }
    say "packages installed"
}

# A cluster from this directory still running -> stop it; a foreign one on our ports -> refuse.
stop_previous() {
    local f
    for f in "$DIR"/run/*.pid; do
        [ -s "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null || continue
        say "a cluster from $DIR is still running; stopping it first"
        bash "$HERE/local-cluster-stop.sh" || die "stop script failed"
        break
    done
    local port ports="6817 $(seq -s ' ' 17001 $((17000 + NODES)))"
    [ "$ACCOUNTING" = 1 ] && ports+=" 6819 3307"
    for port in $ports; do
        ! port_open "$port" || die "port $port is already in use (a cluster started with another MHPC_SLURM_DIR?)"
    done
}

prepare_dirs() {
    rm -rf "$DIR"/{etc,state,spool,log,run,db}          # fresh state: job ids restart at 1
    mkdir -p "$DIR"/{etc,state,log,run}
    local n i=0
    for n in $(nodes); do
        i=$((i + 1))
        mkdir -p "$DIR/spool/$n"                         # slurmd needs it before it starts
        # 127.0.0.0/8 is all loopback: every node gets 127.0.0.(10+i), resolvable by name
        grep -qE "^127\.0\.0\.$((10 + i))[[:space:]]+$n([[:space:]]|$)" /etc/hosts \
            || echo "127.0.0.$((10 + i)) $n" >>/etc/hosts
    done
}

write_slurm_conf() {
    local accounting="AccountingStorageType=accounting_storage/none"
    [ "$ACCOUNTING" = 1 ] && accounting="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
# refuse an unknown --account or a --qos the account may not use, as real sites do
AccountingStorageEnforce=associations,qos"
    cat >"$SLURM_CONF" <<EOF
# generated by slurm/local-cluster-start.sh - do not edit, it is rewritten on every start
ClusterName=mhpc
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
# no munge; cred_expire=5 (the minimum) so a requeued job restarts after ~6 s instead of ~121 s
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups and no systemd here: /proc based tracking, no binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
$accounting
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
# a job whose dependency can never be satisfied (afterok on a failed job) is cancelled, not left pending
DependencyParameters=kill_invalid_depend
JobRequeue=1
# all nodes share the machine's real cores: trust CPUs= below instead of draining the nodes
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
MinJobAge=600
$EXTRA_CONF
EOF
    local n i=0
    for n in $(nodes); do
        i=$((i + 1))
        echo "NodeName=$n NodeAddr=127.0.0.$((10 + i)) Port=$((17000 + i)) CPUs=$CPUS RealMemory=4096" \
            "Features=cpu,rack$(( (i + 1) / 2 )) State=UNKNOWN"
    done >>"$SLURM_CONF"
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$SLURM_CONF"
}

start_mariadb() {
    # fresh datadir on every start: the wiped slurmctld state reuses job ids, an old DB would
    # report the states of old jobs under the same ids
    mariadb-install-db --user=root --datadir="$DIR/db/data" --auth-root-authentication-method=socket \
        --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed"
    # --no-defaults ignores /etc/mysql; TCP on 127.0.0.1:3307 because slurmdbd cannot use a socket path
    nohup mariadbd --no-defaults --user=root --datadir="$DIR/db/data" --socket="$DIR/db/mysqld.sock" \
        --pid-file="$DIR/run/mariadb.pid" --bind-address=127.0.0.1 --port=3307 \
        --log-error="$DIR/log/mariadb.err" --innodb-buffer-pool-size=64M --skip-log-bin \
        </dev/null >/dev/null 2>&1 &
    wait_until 30 mariadb-admin --socket="$DIR/db/mysqld.sock" ping || die "MariaDB did not come up (see $DIR/log/mariadb.err)"
    local host sql=""
    for host in 127.0.0.1 localhost; do
        sql+="CREATE USER 'slurm'@'$host' IDENTIFIED BY '$DB_PASS'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'$host';"
    done
    mariadb --socket="$DIR/db/mysqld.sock" -e "$sql" || die "could not create the slurm DB user"
    say "MariaDB up on 127.0.0.1:3307"
}

start_slurmdbd() {
    # slurmdbd looks for slurmdbd.conf next to $SLURM_CONF; it must be mode 600
    cat >"$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/none
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3307
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$DIR/etc/slurmdbd.conf"
    # the daemons fork into the background themselves; never let them inherit our stdout/stderr
    slurmdbd </dev/null >>"$DIR/log/slurmdbd.out" 2>&1 || die "slurmdbd did not start"
    wait_until 30 port_open 6819 || die "slurmdbd does not listen on 6819 (see $DIR/log/slurmdbd.log)"
    say "slurmdbd up on port 6819"
}

cluster_registered() { sacctmgr -n -P list cluster format=cluster | grep -qx mhpc; }

start_slurmctld() {
    slurmctld -i </dev/null >>"$DIR/log/slurmctld.out" 2>&1 || die "slurmctld did not start"
    wait_until 30 scontrol ping || die "slurmctld does not answer (see $DIR/log/slurmctld.log)"
    # slurmctld registers the cluster in slurmdbd by itself; jobs are only accounted after that
    if [ "$ACCOUNTING" = 1 ]; then
        wait_until 30 cluster_registered || die "cluster 'mhpc' never showed up in slurmdbd"
    fi
    say "slurmctld up on port 6817"
}

assoc_known() { scontrol show assoc_mgr flags=assoc accounts=mhpc-test users=root | grep -q 'Account=mhpc-test UserName=root('; }

add_accounts() {
    # root's own association (account root, QOS normal) comes with the cluster; a test account and QOS on top
    sacctmgr -i add qos mhpc-high >/dev/null || die "sacctmgr could not add the QOS mhpc-high"
    sacctmgr -i add account mhpc-test cluster=mhpc >/dev/null || die "sacctmgr could not add the account mhpc-test"
    sacctmgr -i add user root account=mhpc-test qos=normal,mhpc-high >/dev/null \
        || die "sacctmgr could not give root the account mhpc-test"
    wait_until 30 assoc_known || die "slurmctld never learned the mhpc-test association from slurmdbd"
    say "account mhpc-test, QOS mhpc-high (enforced)"
}

all_idle() { [ "$(sinfo -h -N -t idle -o '%N' | sort -u | wc -l)" -ge "$NODES" ]; }

start_slurmds() {
    local n
    for n in $(nodes); do
        # own UTS namespace: `hostname` == node name inside jobs; -N picks NodeName/Port from slurm.conf
        unshare --uts sh -c "hostname $n && exec slurmd -N $n" </dev/null >>"$DIR/log/slurmd-$n.out" 2>&1 \
            || die "slurmd $n did not start"
    done
    if ! wait_until 60 all_idle; then
        sinfo -N -l >&2 || true
        tail -n 5 "$DIR"/log/slurmd-*.log >&2 || true
        die "nodes did not become idle"
    fi
    say "$NODES nodes idle ($CPUS CPUs each), partition 'debug'"
}

main() {
    check_args
    install_packages
    stop_previous
    prepare_dirs
    write_slurm_conf
    if [ "$ACCOUNTING" = 1 ]; then start_mariadb; start_slurmdbd; fi
    start_slurmctld
    if [ "$ACCOUNTING" = 1 ]; then add_accounts; fi
    start_slurmds
    sinfo -N
    echo "export SLURM_CONF=$SLURM_CONF"
}

main "$@"
