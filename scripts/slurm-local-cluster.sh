#!/usr/bin/env bash
# slurm-local-cluster.sh - bring up, check, fail and tear down a REAL Slurm cluster of N
# emulated nodes (node1..nodeN) on this one machine (Debian 12, root, no systemd needed).
#
#   slurm-local-cluster.sh up N [--no-accounting]   start (idempotent), wait until N nodes are idle
#   slurm-local-cluster.sh down                     stop everything this script started, remove it all
#   slurm-local-cluster.sh status                   up or not, daemons, sinfo (exit 0 when up)
#   slurm-local-cluster.sh check                    N nodes idle + `srun -N N hostname` on N nodes
#   slurm-local-cluster.sh fail NODE crash|hang|slurmd|down|drain [--wait]
#   slurm-local-cluster.sh recover NODE             thaw, restart slurmd, resume, wait until idle
#   slurm-local-cluster.sh nodes                    node names, one per line
#   slurm-local-cluster.sh pids NODE                PIDs of every process of that emulated node
#
# Each node is an ordinary `slurmd -N nodeX` with its own Port, its own loopback address
# (127.0.0.1X), its own UTS namespace (hostname nodeX), its own /dev/shm (a mount namespace with a
# private tmpfs) and its own cgroup (so a whole node can be
# killed or frozen). See docs/slurm-local-cluster.md.
#
# Environment knobs: SLURM_LOCAL_DIR (/tmp/deadpool-slurm), SLURM_LOCAL_CPUS (2),
# SLURM_LOCAL_MEM (4000 MB), SLURM_LOCAL_CONF (/etc/slurm/slurm.conf), SLURM_LOCAL_CGROUP
# (auto|v2|v1|none), SLURM_LOCAL_WAIT (60 s), SLURM_LOCAL_CTLD_PORT (6817),
# SLURM_LOCAL_DBD_PORT (6819), SLURM_LOCAL_DB_PORT (17306), SLURM_LOCAL_NODE_PORT_BASE (17000),
# SLURM_LOCAL_KEEP_ON_FAILURE=1 (do not tear down after a failed `up`).
#
# Safety: this script only ever signals PIDs read from its own pid files (checked against the
# expected command name), processes inside its own cgroups, and slurmstepds that hold its own
# log files open (plus their descendants). It never kills by name pattern.

set -euo pipefail

PROG=slurm-local-cluster.sh
SELF=$(readlink -f "${BASH_SOURCE[0]}")
DIR=${SLURM_LOCAL_DIR:-/tmp/deadpool-slurm}
DIR=${DIR%/}
CONF=${SLURM_LOCAL_CONF:-/etc/slurm/slurm.conf}
CPUS=${SLURM_LOCAL_CPUS:-2}
MEM=${SLURM_LOCAL_MEM:-4000}
CLUSTER=${SLURM_LOCAL_CLUSTER:-local}
CTLD_PORT=${SLURM_LOCAL_CTLD_PORT:-6817}
DBD_PORT=${SLURM_LOCAL_DBD_PORT:-6819}
DB_PORT=${SLURM_LOCAL_DB_PORT:-17306}
NODE_PORT_BASE=${SLURM_LOCAL_NODE_PORT_BASE:-17000}
CGROUP_WANT=${SLURM_LOCAL_CGROUP:-auto}
WAIT_S=${SLURM_LOCAL_WAIT:-60}
HOSTS_FILE=/etc/hosts
MARK="# managed-by: $PROG"
DIR_MARKER=.managed-by-slurm-local-cluster
CGNAME=$(basename "$DIR" | tr -c 'A-Za-z0-9_.\n-' '_')
STATE=$DIR/cluster.env
CORE_PKGS=(slurmctld slurmd slurm-client munge libpmix2 libpmix-dev)
ACCT_PKGS=(slurmdbd mariadb-server mariadb-client)

# Filled by load_state / cg_detect.
NODES=0
ACCOUNTING=0
CGMODE=none
CGROOT=

export SLURM_CONF=$CONF

log() { printf '[slurm-local] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
# show_logs FILE...: the last lines of those of $DIR/log/FILE that exist and are not empty.
show_logs() {
    local f
    for f in "$@"; do
        [[ -s $DIR/log/$f ]] || continue
        log "--- $DIR/log/$f (last lines):"
        tail -n 15 "$DIR/log/$f" >&2 || true
    done
}
need_root() { [[ $(id -u) == 0 ]] || die "must run as root (the emulated nodes run slurmd as root)"; }

lock() {
    # Serialise mutating commands. Every daemon is started with `9<&-` so none inherits the lock.
    exec 9<"$SELF"
    flock -w 600 9 || die "could not get the lock on $SELF"
}

# ---------------------------------------------------------------- processes

# alive PID: the process exists and is not a zombie (PID 1 here reaps late: pitfall 9).
alive() {
    local pid=${1:-} stat rest
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    { read -r stat </proc/"$pid"/stat; } 2>/dev/null || return 1
    rest=${stat##*) }
    [[ ${rest:0:1} != Z && ${rest:0:1} != X ]]
}

comm_of() { { cat /proc/"$1"/comm; } 2>/dev/null || true; }

# pidfile_pid FILE COMM: the live PID from FILE if its command name is COMM, else nothing.
pidfile_pid() {
    local f=$1 want=$2 pid
    [[ -f $f ]] || return 0
    pid=$(tr -dc '0-9' <"$f" 2>/dev/null || true)
    if alive "$pid" && [[ $(comm_of "$pid") == "$want" ]]; then echo "$pid"; fi
}

# wait_gone PID... within SECONDS (first arg)
wait_gone() {
    local secs=$1 p left deadline
    shift
    deadline=$(($(date +%s) + secs))
    while :; do
        left=0
        for p in "$@"; do alive "$p" && left=1; done
        ((left)) || return 0
        (($(date +%s) >= deadline)) && return 1
        sleep 0.1
    done
}

# stop_pid PID: SIGTERM, then SIGKILL after 10 s.
stop_pid() {
    local pid=$1
    alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    kill -CONT "$pid" 2>/dev/null || true
    if ! wait_gone 10 "$pid"; then
        kill -KILL "$pid" 2>/dev/null || true
        wait_gone 5 "$pid" || log "warning: PID $pid did not exit"
    fi
}

# descendants PID...: every live descendant of the given PIDs (not the PIDs themselves).
descendants() {
    local -A kids=()
    local f stat rest pid ppid
    for f in /proc/[0-9]*/stat; do
        { read -r stat <"$f"; } 2>/dev/null || continue
        pid=${f#/proc/}
        pid=${pid%/stat}
        rest=${stat##*) }
        [[ ${rest:0:1} == Z ]] && continue
        rest=${rest#* }
        ppid=${rest%% *}
        kids[$ppid]+="$pid "
    done
    local queue=("$@") out=() p c
    while ((${#queue[@]})); do
        p=${queue[0]}
        queue=("${queue[@]:1}")
        for c in ${kids[$p]:-}; do
            out+=("$c")
            queue+=("$c")
        done
    done
    ((${#out[@]})) && printf '%s\n' "${out[@]}"
    return 0
}

# stepds_of NODE: live slurmstepds holding the node's slurmd log file open (SlurmdLogFile uses %n).
stepds_of() {
    local n=$1 logf fd pid
    logf=$DIR/log/slurmd-$n.log
    [[ -e $logf ]] || return 0
    find /proc/[0-9]*/fd -maxdepth 1 -lname "$logf" 2>/dev/null | while read -r fd; do
        pid=${fd#/proc/}
        pid=${pid%%/*}
        if alive "$pid" && [[ $(comm_of "$pid") == slurmstepd ]]; then echo "$pid"; fi
    done | sort -un || true
}

slurmd_pid() { pidfile_pid "$DIR/run/slurmd-$1.pid" slurmd; }

# ---------------------------------------------------------------- cgroups

cg_try_v2() {
    local base=$1
    [[ $(stat -fc %T "$base" 2>/dev/null) == cgroup2fs ]] || return 1
    mkdir -p "$base/$CGNAME" 2>/dev/null || return 1
    [[ -e $base/$CGNAME/cgroup.procs ]] || return 1
    CGMODE=v2
    CGROOT=$base/$CGNAME
}

cg_try_v1() {
    local base=/sys/fs/cgroup/freezer
    [[ $(stat -fc %T "$base" 2>/dev/null) == cgroupfs ]] || return 1
    mkdir -p "$base/$CGNAME" 2>/dev/null || return 1
    [[ -e $base/$CGNAME/freezer.state ]] || { rmdir "$base/$CGNAME" 2>/dev/null; return 1; }
    CGMODE=v1
    CGROOT=$base/$CGNAME
}

# cg_detect: pick the cgroup layout (pure v2, hybrid v2 at /sys/fs/cgroup/unified, v1 freezer, none).
cg_detect() {
    CGMODE=none
    CGROOT=
    case $CGROUP_WANT in
    none) ;;
    v2) cg_try_v2 /sys/fs/cgroup || cg_try_v2 /sys/fs/cgroup/unified || die "no usable cgroup v2 hierarchy" ;;
    v1) cg_try_v1 || die "no usable cgroup v1 freezer hierarchy" ;;
    auto) cg_try_v2 /sys/fs/cgroup || cg_try_v2 /sys/fs/cgroup/unified || cg_try_v1 || true ;;
    *) die "SLURM_LOCAL_CGROUP must be auto, v2, v1 or none" ;;
    esac
}

cg_dir() { echo "$CGROOT/$1"; }

# cg_procs NODE: live PIDs in the node's cgroup.
cg_procs() {
    local d p
    d=$(cg_dir "$1")
    [[ -f $d/cgroup.procs ]] || return 0
    while read -r p; do alive "$p" && echo "$p"; done <"$d/cgroup.procs"
    return 0
}

cg_freeze() {
    local d
    d=$(cg_dir "$1")
    [[ -d $d ]] || return 0
    case $CGMODE in
    v2) echo 1 >"$d/cgroup.freeze" ;;
    v1) echo FROZEN >"$d/freezer.state" ;;
    esac
}

cg_thaw() {
    local d
    d=$(cg_dir "$1")
    [[ -d $d ]] || return 0
    case $CGMODE in
    v2) echo 0 >"$d/cgroup.freeze" 2>/dev/null || true ;;
    v1) echo THAWED >"$d/freezer.state" 2>/dev/null || true ;;
    esac
}

# cg_kill NODE: SIGKILL everything in the node's cgroup and wait until it is empty.
cg_kill() {
    local n=$1 d i pids
    d=$(cg_dir "$n")
    [[ -d $d ]] || return 0
    for ((i = 0; i < 100; i++)); do
        pids=$(cg_procs "$n")
        [[ -z $pids ]] && return 0
        if [[ $CGMODE == v2 && -e $d/cgroup.kill ]]; then
            echo 1 >"$d/cgroup.kill"
        else
            # freeze so nothing can fork in between, kill, thaw (frozen tasks die only when thawed)
            cg_freeze "$n" 2>/dev/null || true
            # shellcheck disable=SC2086
            kill -KILL $(cg_procs "$n") 2>/dev/null || true
        fi
        cg_thaw "$n"
        sleep 0.1
    done
    log "warning: processes left in $d: $(cg_procs "$n" | tr '\n' ' ')"
}

cg_rmdir() {
    local d=$1 i
    [[ -d $d ]] || return 0
    for ((i = 0; i < 50; i++)); do
        rmdir "$d" 2>/dev/null && return 0
        sleep 0.1
    done
    log "warning: could not remove cgroup $d"
}

# ---------------------------------------------------------------- node process sets

# node_pids NODE: every live process of the emulated node.
node_pids() {
    local n=$1 roots=() p
    if [[ $CGMODE != none ]]; then
        cg_procs "$n" | sort -n
        return 0
    fi
    p=$(slurmd_pid "$n")
    [[ -n $p ]] && roots+=("$p")
    while read -r p; do [[ -n $p ]] && roots+=("$p"); done < <(stepds_of "$n")
    ((${#roots[@]})) || return 0
    { printf '%s\n' "${roots[@]}"; descendants "${roots[@]}"; } | sort -un
}

node_kill() {
    local n=$1 pids i
    if [[ $CGMODE != none ]]; then
        cg_kill "$n"
    fi
    # In every mode (and as a safety net): its slurmd by pid file, its slurmstepds, their descendants.
    for ((i = 0; i < 50; i++)); do
        local CGMODE=none
        pids=$(node_pids "$n")
        [[ -z $pids ]] && return 0
        # shellcheck disable=SC2086
        kill -STOP $pids 2>/dev/null || true
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
        sleep 0.1
    done
    log "warning: processes of $n left: $pids"
}

node_freeze() {
    local n=$1 pids
    if [[ $CGMODE != none ]]; then
        cg_freeze "$n"
    else
        pids=$(node_pids "$n")
        # shellcheck disable=SC2086
        [[ -n $pids ]] && kill -STOP $pids 2>/dev/null || true
    fi
}

node_thaw() {
    local n=$1 pids
    if [[ $CGMODE != none ]]; then
        cg_thaw "$n"
    else
        pids=$(node_pids "$n")
        # shellcheck disable=SC2086
        [[ -n $pids ]] && kill -CONT $pids 2>/dev/null || true
    fi
}

# ---------------------------------------------------------------- state, config, hosts

load_state() {
    [[ -f $STATE ]] || return 1
    local k v
    while IFS='=' read -r k v; do
        case $k in
        NODES | ACCOUNTING | CGMODE | CGROOT | CONF | CPUS | MUNGE_OURS) printf -v "$k" '%s' "$v" ;;
        esac
    done <"$STATE"
    export SLURM_CONF=$CONF
}

save_state() {
    cat >"$STATE" <<EOF
NODES=$NODES
ACCOUNTING=$ACCOUNTING
CGMODE=$CGMODE
CGROOT=$CGROOT
CONF=$CONF
CPUS=$CPUS
EOF
}

node_names() {
    local i
    for ((i = 1; i <= NODES; i++)); do echo "node$i"; done
}

valid_node() {
    local n=$1
    [[ $n =~ ^node([0-9]+)$ ]] && ((BASH_REMATCH[1] >= 1 && BASH_REMATCH[1] <= NODES)) ||
        die "unknown node '$n' (nodes: node1..node$NODES)"
}

conf_is_ours() { [[ -f $1 ]] && grep -q "^$MARK" "$1"; }

# conf_dir_of FILE: the dir= recorded in our managed-by line.
conf_dir_of() { sed -n "s|^$MARK .*dir=\([^ )]*\).*|\1|p" "$1" | head -n1; }

write_conf() {
    local ctlhost i mpiconf tmp
    ctlhost=$(uname -n)
    ctlhost=${ctlhost%%.*}
    mkdir -p "$(dirname "$CONF")"
    tmp=$CONF.tmp.$$
    {
        echo "$MARK (nodes=$NODES dir=$DIR) - removed by '$PROG down'; do not edit"
        cat <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$ctlhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
# per-node /tmp: the pmix plugin puts spmix_appdir_<uid>_<job>.<step> there; a shared /tmp collides
TmpFS=$DIR/tmp/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups / systemd needed
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# trust the CPUs/RealMemory below instead of the real hardware
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=pmi2
MailProg=/bin/true
# only nodes that were DOWN for not responding come back by themselves when their slurmd registers
ReturnToService=1
SlurmdTimeout=5
SlurmctldTimeout=10
MessageTimeout=2
InactiveLimit=0
KillWait=5
MinJobAge=300
EOF
        if ((ACCOUNTING)); then
            cat <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
EOF
        else
            echo "AccountingStorageType=accounting_storage/none"
        fi
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "JobCompType=jobcomp/none"
        for ((i = 1; i <= NODES; i++)); do
            echo "NodeName=node$i NodeHostname=node$i NodeAddr=127.0.0.1$i Port=$((NODE_PORT_BASE + i))" \
                "CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
    } >"$tmp"
    mv -f "$tmp" "$CONF"

    mpiconf=$(dirname "$CONF")/mpi.conf
    if [[ -e $mpiconf ]] && ! conf_is_ours "$mpiconf"; then
        log "warning: $mpiconf exists and was not written by $PROG; leaving it alone"
    else
        printf '%s (dir=%s)\nPMIxEnv=PMIX_SECURITY_MODE=native\n' "$MARK" "$DIR" >"$mpiconf"
    fi

    if ((ACCOUNTING)); then
        cat >"$DIR/etc/slurmdbd.conf" <<EOF
$MARK (dir=$DIR)
AuthType=auth/munge
DbdHost=$ctlhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
DebugLevel=info
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
        chmod 600 "$DIR/etc/slurmdbd.conf"
    fi
}

remove_conf() {
    local conf=$1 mpiconf d
    mpiconf=$(dirname "$conf")/mpi.conf
    if conf_is_ours "$conf"; then
        d=$(conf_dir_of "$conf")
        if [[ -z $d || $d == "$DIR" ]]; then rm -f "$conf"; else
            log "note: $conf belongs to another cluster (dir=$d); left in place"
        fi
    fi
    if conf_is_ours "$mpiconf"; then
        d=$(sed -n 's|.*dir=\([^ )]*\).*|\1|p' "$mpiconf" | head -n1)
        [[ -z $d || $d == "$DIR" ]] && rm -f "$mpiconf"
    fi
    return 0
}

hosts_begin() { echo "# BEGIN $PROG dir=$DIR"; }
hosts_end() { echo "# END $PROG dir=$DIR"; }

# Rewrite /etc/hosts in place (it may be a bind mount, so no rename).
hosts_remove() {
    local b e content
    b=$(hosts_begin)
    e=$(hosts_end)
    grep -qxF "$b" "$HOSTS_FILE" 2>/dev/null || return 0
    content=$(awk -v b="$b" -v e="$e" '$0 == b { skip = 1; next } $0 == e { skip = 0; next } !skip' "$HOSTS_FILE")
    printf '%s\n' "$content" >"$HOSTS_FILE"
}

hosts_add() {
    local i
    hosts_remove
    {
        hosts_begin
        for ((i = 1; i <= NODES; i++)); do echo "127.0.0.1$i node$i"; done
        hosts_end
    } >>"$HOSTS_FILE"
}

# ---------------------------------------------------------------- slurm helpers

sinfo_states() { timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null | sort -u -V; }

# count_nodes_in STATE_REGEX: how many of node1..nodeN are in a state matching the regex.
count_nodes_in() {
    local re=$1
    sinfo_states | awk -v re="^($re)\$" -v max="$NODES" '
        { n = $1; if (sub(/^node/, "", n) && n ~ /^[0-9]+$/ && n + 0 >= 1 && n + 0 <= max + 0 && $2 ~ re) c++ }
        END { print c + 0 }'
}

# wait_nodes STATE_REGEX NODE_OR_ALL SECONDS
wait_nodes() {
    local re=$1 which=$2 secs=$3 deadline st
    deadline=$(($(date +%s) + secs))
    while :; do
        if [[ $which == all ]]; then
            [[ $(count_nodes_in "$re") == "$NODES" ]] && return 0
        else
            st=$(timeout 10 sinfo -h -N -n "$which" -o '%t' 2>/dev/null | head -n1)
            [[ $st =~ ^($re)$ ]] && return 0
        fi
        (($(date +%s) >= deadline)) && return 1
        sleep 0.2
    done
}

ctld_up() { timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP'; }

port_busy() {
    local hex
    hex=$(printf ':%04X' "$1")
    awk -v p="$hex" '$4 == "0A" && substr($2, length($2) - 4) == p { f = 1 } END { exit !f }' /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

wait_port() {
    local port=$1 secs=$2 deadline
    deadline=$(($(date +%s) + secs))
    until port_busy "$port"; do
        (($(date +%s) >= deadline)) && return 1
        sleep 0.1
    done
}

# wait_pidfile FILE COMM SECONDS
wait_pidfile() {
    local f=$1 comm=$2 secs=$3 deadline
    deadline=$(($(date +%s) + secs))
    until [[ -n $(pidfile_pid "$f" "$comm") ]]; do
        (($(date +%s) >= deadline)) && return 1
        sleep 0.1
    done
}

munge_ok() { timeout 5 munge -n 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1; }

# ---------------------------------------------------------------- packages

pkg_missing() {
    local p
    for p in "$@"; do
        dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' || echo "$p"
    done
}

install_packages() {
    local missing t0 rc policy_added=0
    mapfile -t missing < <(pkg_missing "$@")
    ((${#missing[@]})) || return 0
    t0=$(now)
    log "installing ${missing[*]} (apt)"
    # Keep package scripts from starting system munge/mariadb services (we run private ones).
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        policy_added=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    rc=0
    timeout 900 apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null >"$DIR/log/apt.log" 2>&1 9<&- || rc=$?
    if ((rc)); then
        log "apt-get install failed (rc=$rc); running apt-get update once and retrying"
        timeout 600 apt-get update -q </dev/null >>"$DIR/log/apt.log" 2>&1 9<&- || true
        rc=0
        timeout 900 apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null >>"$DIR/log/apt.log" 2>&1 9<&- || rc=$?
    fi
    ((policy_added)) && rm -f /usr/sbin/policy-rc.d
    ((rc == 0)) || { show_logs apt.log; die "apt-get install failed (see above)"; }
    log "packages installed in $(since "$t0") s"
}

# ---------------------------------------------------------------- daemons

start_munge() {
    MUNGE_OURS=0
    if munge_ok; then
        log "munge: using the munged already running"
        return 0
    fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "munge: creating /etc/munge/munge.key"
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile=/etc/munge/munge.key 9<&- || die "mungekey failed"
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
        fi
        chown munge:munge /etc/munge/munge.key
        chmod 400 /etc/munge/munge.key
    fi
    install -d -o munge -g munge -m 755 /run/munge
    # munged daemonizes itself; --force gets past a stale socket left by a killed munged.
    (cd / && exec runuser -u munge -- /usr/sbin/munged --force) </dev/null >>"$DIR/log/munged.out" 2>&1 9<&- ||
        die "munged failed to start (see $DIR/log/munged.out)"
    local i
    for ((i = 0; i < 50; i++)); do munge_ok && break; sleep 0.1; done
    munge_ok || die "munge does not work after starting munged"
    local pid
    pid=$(pidfile_pid /run/munge/munged.pid munged)
    [[ -n $pid ]] && echo "$pid" >"$DIR/run/munged.pid"
    MUNGE_OURS=1
    log "munge: started munged (PID ${pid:-?})"
}

mysql_root() { timeout 20 mariadb --no-defaults -S "$DIR/mysql/mysqld.sock" -u root "$@"; }

start_mariadb() {
    local t0 i
    t0=$(now)
    mkdir -p "$DIR/mysql/data"
    timeout 120 mariadb-install-db --no-defaults --user=root --datadir="$DIR/mysql/data" \
        --auth-root-authentication-method=socket </dev/null >"$DIR/log/mariadb-install.log" 2>&1 9<&- ||
        { show_logs mariadb-install.log; die "mariadb-install-db failed"; }
    (cd / && exec setsid -f mariadbd --no-defaults --user=root --datadir="$DIR/mysql/data" \
        --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
        --socket="$DIR/mysql/mysqld.sock" --pid-file="$DIR/run/mariadbd.pid" \
        --log-error="$DIR/log/mariadb.log" \
        --innodb-buffer-pool-size=1G --innodb-lock-wait-timeout=900) </dev/null >/dev/null 2>&1 9<&-
    for ((i = 0; i < 300; i++)); do
        mysql_root -e 'SELECT 1' >/dev/null 2>&1 && break
        sleep 0.1
    done
    mysql_root -e 'SELECT 1' >/dev/null 2>&1 || { show_logs mariadb.log; die "mariadbd did not start"; }
    mysql_root -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
        CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" || die "could not create the slurm database user"
    log "mariadb: up on 127.0.0.1:$DB_PORT in $(since "$t0") s"
}

start_slurmdbd() {
    # slurmdbd has no -f: it reads slurmdbd.conf from the directory of $SLURM_CONF.
    ln -sf "$CONF" "$DIR/etc/slurm.conf"
    (cd / && SLURM_CONF=$DIR/etc/slurm.conf exec setsid -f slurmdbd) </dev/null >>"$DIR/log/slurmdbd.out" 2>&1 9<&-
    wait_pidfile "$DIR/run/slurmdbd.pid" slurmdbd 30 && wait_port "$DBD_PORT" 30 ||
        { show_logs slurmdbd.out slurmdbd.log; die "slurmdbd did not start"; }
    log "slurmdbd: up on 127.0.0.1:$DBD_PORT"
}

start_slurmctld() {
    local i
    (cd / && exec setsid -f slurmctld -f "$CONF" -i) </dev/null >>"$DIR/log/slurmctld.out" 2>&1 9<&-
    wait_pidfile "$DIR/run/slurmctld.pid" slurmctld 30 ||
        { show_logs slurmctld.out slurmctld.log; die "slurmctld did not start"; }
    for ((i = 0; i < 150; i++)); do ctld_up && break; sleep 0.2; done
    ctld_up || { show_logs slurmctld.log; die "slurmctld does not answer 'scontrol ping'"; }
    log "slurmctld: up on 127.0.0.1:$CTLD_PORT"
}

# start_slurmd NODE: start the node's slurmd inside the node's cgroup and UTS namespace.
start_slurmd() {
    local n=$1 cg=
    rm -f "$DIR/run/slurmd-$n.pid"
    mkdir -p "$DIR/spool/$n" "$DIR/tmp/$n"
    if [[ $CGMODE != none ]]; then
        cg=$(cg_dir "$n")
        mkdir -p "$cg"
    fi
    (
        [[ -n $cg ]] && echo "$BASHPID" >"$cg/cgroup.procs"
        cd /
        # shellcheck disable=SC2016
        # its own /dev/shm too (a mount namespace with a private tmpfs): MPICH's segments of the node's tasks
        # stay on the node and go with it when it crashes, as on real hardware, instead of piling up in this
        # machine's /dev/shm and showing up in the local tests that run beside the Slurm tests
        exec unshare --uts --mount --propagation private sh -c '
            mount -t tmpfs -o mode=1777,size=2g tmpfs /dev/shm || exit 1
            hostname "$1" 2>/dev/null || echo "$1" >/proc/sys/kernel/hostname || exit 1
            exec setsid -f slurmd -f "$2" -N "$1"' sh "$n" "$CONF"
    ) </dev/null >>"$DIR/log/slurmd-$n.out" 2>&1 9<&-
}

wait_slurmd() {
    local n=$1
    wait_pidfile "$DIR/run/slurmd-$n.pid" slurmd 30 ||
        { show_logs "slurmd-$n.out" "slurmd-$n.log"; die "slurmd for $n did not start"; }
}

# ---------------------------------------------------------------- commands

# healthy: every daemon alive and every node responding and usable.
healthy() {
    local n
    [[ -n $(pidfile_pid "$DIR/run/slurmctld.pid" slurmctld) ]] || return 1
    if ((ACCOUNTING)); then
        [[ -n $(pidfile_pid "$DIR/run/slurmdbd.pid" slurmdbd) ]] || return 1
        [[ -n $(pidfile_pid "$DIR/run/mariadbd.pid" mariadbd) ]] || return 1
    fi
    for n in $(node_names); do [[ -n $(slurmd_pid "$n") ]] || return 1; done
    munge_ok || return 1
    [[ $(count_nodes_in 'idle|alloc|mix|comp') == "$NODES" ]]
}

cmd_up() {
    local want=${1:-} acct=1 t0 n
    shift || true
    [[ $want =~ ^[0-9]+$ ]] || die "usage: $PROG up N [--no-accounting]"
    for a in "$@"; do
        case $a in
        --no-accounting) acct=0 ;;
        *) die "unknown option $a" ;;
        esac
    done
    ((want >= 1 && want <= 99)) || die "N must be 1..99 (node addresses are 127.0.0.1N)"
    local v
    for v in CPUS MEM WAIT_S CTLD_PORT DBD_PORT DB_PORT NODE_PORT_BASE; do
        [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v (SLURM_LOCAL_...) must be a positive integer, not '${!v}'"
    done
    need_root
    lock
    t0=$(now)

    if load_state; then
        if [[ -n $(pidfile_pid "$DIR/run/slurmctld.pid" slurmctld) ]]; then
            ((NODES == want)) || die "already up with $NODES nodes (dir $DIR); run '$PROG down' first"
            ((acct && !ACCOUNTING)) && die "already up without accounting; run '$PROG down' first"
            if healthy; then
                log "already up: $NODES nodes (dir $DIR) - checked in $(since "$t0") s"
                return 0
            fi
            if ((!ACCOUNTING)) || [[ -n $(pidfile_pid "$DIR/run/slurmdbd.pid" slurmdbd) ]]; then
                log "up but not healthy; repairing"
                munge_ok || start_munge
                for n in $(node_names); do
                    node_thaw "$n"
                    [[ -n $(slurmd_pid "$n") ]] || start_slurmd "$n"
                done
                for n in $(node_names); do wait_slurmd "$n"; done
                for n in $(node_names); do
                    timeout 10 scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true
                done
                wait_nodes 'idle|alloc|mix' all "$WAIT_S" || die "nodes not ready after repair: $(sinfo_states | tr '\n' ' ')"
                log "repaired: $NODES nodes in $(since "$t0") s"
                return 0
            fi
        fi
    fi
    if [[ -e $DIR || -e $STATE ]] || conf_is_ours "$CONF"; then
        log "cleaning up a previous, incomplete cluster first"
        do_down
    fi
    if [[ -e $CONF ]] && ! conf_is_ours "$CONF"; then
        die "$CONF exists and was not written by $PROG; refusing to overwrite it"
    fi
    if conf_is_ours "$CONF"; then
        local other
        other=$(conf_dir_of "$CONF")
        [[ -n $other && $other != "$DIR" && -e $other ]] &&
            die "$CONF belongs to another cluster (SLURM_LOCAL_DIR=$other); take that one down first"
    fi

    NODES=$want
    ACCOUNTING=$acct
    mkdir -p "$DIR"/{run,log,etc,state,spool,tmp}
    touch "$DIR/$DIR_MARKER"
    if ((ACCOUNTING)); then install_packages "${CORE_PKGS[@]}" "${ACCT_PKGS[@]}"; else install_packages "${CORE_PKGS[@]}"; fi

    local p busy=()
    for ((p = 1; p <= NODES; p++)); do port_busy $((NODE_PORT_BASE + p)) && busy+=($((NODE_PORT_BASE + p))); done
    port_busy "$CTLD_PORT" && busy+=("$CTLD_PORT")
    if ((ACCOUNTING)); then
        port_busy "$DBD_PORT" && busy+=("$DBD_PORT")
        port_busy "$DB_PORT" && busy+=("$DB_PORT")
    fi
    if ((${#busy[@]})); then
        rm -rf "$DIR"
        die "TCP ports already in use: ${busy[*]} (another Slurm? see SLURM_LOCAL_*PORT* knobs)"
    fi

    # From here on, a failure tears down what was started (unless SLURM_LOCAL_KEEP_ON_FAILURE=1).
    trap 'up_failed' EXIT
    cg_detect
    save_state
    log "cgroups: $CGMODE${CGROOT:+ ($CGROOT)}"
    start_munge
    echo "MUNGE_OURS=$MUNGE_OURS" >>"$STATE"
    write_conf
    hosts_add
    if ((ACCOUNTING)); then
        start_mariadb
        start_slurmdbd
    fi
    start_slurmctld
    for n in $(node_names); do start_slurmd "$n"; done
    for n in $(node_names); do wait_slurmd "$n"; done
    wait_nodes idle all "$WAIT_S" || die "not all $NODES nodes idle after ${WAIT_S}s: $(sinfo_states | tr '\n' ' ')"
    if ((ACCOUNTING)); then
        local i
        for ((i = 0; i < 100; i++)); do
            timeout 10 sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER" && break
            sleep 0.2
        done
        timeout 10 sacct -n -X -o JobID >/dev/null 2>&1 || die "sacct does not work (see $DIR/log/slurmdbd.log)"
    fi
    trap - EXIT
    log "up: $NODES nodes x $CPUS CPUs, accounting $( ((ACCOUNTING)) && echo on || echo off), ready in $(since "$t0") s"
    [[ $CONF == /etc/slurm/slurm.conf ]] || log "clients need: export SLURM_CONF=$CONF"
    timeout 10 sinfo || true
}

up_failed() {
    local rc=$?
    ((rc)) || return 0
    if [[ ${SLURM_LOCAL_KEEP_ON_FAILURE:-0} == 1 ]]; then
        log "up failed; leaving everything in place (logs in $DIR/log); run '$PROG down' to clean up"
    else
        log "up failed; tearing down (set SLURM_LOCAL_KEEP_ON_FAILURE=1 to keep the logs)"
        do_down || true
    fi
    exit "$rc"
}

# stop_daemon PIDFILE COMM: stop it, then any of its children that outlive it (slurmscriptd).
stop_daemon() {
    local pid kids=() k comms=()
    pid=$(pidfile_pid "$1" "$2")
    [[ -n $pid ]] || return 0
    mapfile -t kids < <(descendants "$pid")
    for k in "${kids[@]}"; do comms+=("$(comm_of "$k")"); done
    stop_pid "$pid"
    for k in "${!kids[@]}"; do
        if alive "${kids[$k]}" && [[ $(comm_of "${kids[$k]}") == "${comms[$k]}" ]]; then
            kill -KILL "${kids[$k]}" 2>/dev/null || true
        fi
    done
}

do_down() {
    local n nodes=() f d base
    MUNGE_OURS=0
    load_state || true
    # All nodes we may have started: from the state, the pid files, the cgroups.
    mapfile -t nodes < <(
        node_names
        for f in "$DIR"/run/slurmd-*.pid "$DIR"/log/slurmd-*.log; do
            [[ -e $f ]] || continue
            f=${f##*/slurmd-}
            echo "${f%.*}"
        done
        for base in /sys/fs/cgroup /sys/fs/cgroup/unified /sys/fs/cgroup/freezer; do
            for d in "$base/$CGNAME"/node*; do [[ -d $d ]] && basename "$d"; done
        done
    )
    mapfile -t nodes < <(printf '%s\n' "${nodes[@]}" | grep -E '^node[0-9]+$' | sort -u -V)

    # Find the cgroup root even without a state file.
    if [[ -z $CGROOT ]]; then
        for base in /sys/fs/cgroup /sys/fs/cgroup/unified /sys/fs/cgroup/freezer; do
            [[ -d $base/$CGNAME ]] || continue
            CGROOT=$base/$CGNAME
            if [[ $(stat -fc %T "$base") == cgroup2fs ]]; then CGMODE=v2; else CGMODE=v1; fi
            break
        done
    fi

    for n in "${nodes[@]}"; do node_kill "$n"; done
    stop_daemon "$DIR/run/slurmctld.pid" slurmctld
    stop_daemon "$DIR/run/slurmdbd.pid" slurmdbd
    stop_daemon "$DIR/run/mariadbd.pid" mariadbd
    stop_daemon "$DIR/run/munged.pid" munged

    for n in "${nodes[@]}"; do [[ -n $CGROOT ]] && cg_rmdir "$CGROOT/$n"; done
    [[ -n $CGROOT ]] && cg_rmdir "$CGROOT"
    remove_conf "$CONF"
    hosts_remove
    if [[ -e $DIR ]]; then
        if [[ -e $DIR/$DIR_MARKER && $DIR == /*/* ]]; then
            rm -rf "$DIR"
        else
            log "warning: $DIR was not created by $PROG; not removing it"
        fi
    fi
}

cmd_down() {
    local t0
    need_root
    lock
    t0=$(now)
    if [[ ! -e $DIR ]] && ! conf_is_ours "$CONF" && ! grep -qxF "$(hosts_begin)" "$HOSTS_FILE" 2>/dev/null; then
        log "not up (nothing in $DIR)"
        return 0
    fi
    do_down
    log "down in $(since "$t0") s"
}

cmd_status() {
    local n pid rc=0
    if ! load_state; then
        echo "down (no cluster in $DIR)"
        return 1
    fi
    pid=$(pidfile_pid "$DIR/run/slurmctld.pid" slurmctld)
    if [[ -n $pid ]] && ctld_up; then
        echo "up: $NODES nodes, dir $DIR, conf $CONF, accounting $( ((ACCOUNTING)) && echo on || echo off), cgroups $CGMODE${CGROOT:+ ($CGROOT)}"
    else
        echo "down or broken: slurmctld not running (dir $DIR); run '$PROG down' or '$PROG up $NODES'"
        rc=1
    fi
    printf '  %-10s %s\n' slurmctld "${pid:-DEAD}"
    if ((ACCOUNTING)); then
        pid=$(pidfile_pid "$DIR/run/slurmdbd.pid" slurmdbd)
        printf '  %-10s %s\n' slurmdbd "${pid:-DEAD}"
        pid=$(pidfile_pid "$DIR/run/mariadbd.pid" mariadbd)
        printf '  %-10s %s\n' mariadbd "${pid:-DEAD}"
    fi
    for n in $(node_names); do
        pid=$(slurmd_pid "$n")
        printf '  %-10s slurmd %s, %s processes\n' "$n" "${pid:-DEAD}" "$(node_pids "$n" | wc -l)"
    done
    if ((rc == 0)); then timeout 10 sinfo || true; fi
    return $rc
}

cmd_check() {
    local ok=1 idle out names expect
    load_state || { echo "check: FAILED: not up (no cluster in $DIR)"; return 1; }
    idle=$(count_nodes_in idle)
    if [[ $idle == "$NODES" ]]; then
        echo "check: $NODES/$NODES nodes idle"
    else
        echo "check: FAILED: $idle/$NODES nodes idle: $(sinfo_states | tr '\n' ' ')"
        ok=0
    fi
    if ((ok)); then
        out=$(timeout 60 srun -N"$NODES" -n"$NODES" --ntasks-per-node=1 hostname 2>"$DIR/log/check-srun.err") || {
            echo "check: FAILED: srun -N$NODES hostname: $out $(cat "$DIR/log/check-srun.err")"
            ok=0
        }
    fi
    if ((ok)); then
        names=$(printf '%s\n' "$out" | sort -u -V | tr '\n' ' ')
        expect=$(node_names | tr '\n' ' ')
        if [[ $names == "$expect" ]]; then
            echo "check: srun -N$NODES hostname -> $names"
        else
            echo "check: FAILED: srun -N$NODES hostname printed '$names', expected '$expect'"
            ok=0
        fi
    fi
    if ((ok && ACCOUNTING)); then
        if timeout 20 sacct -n -X -o JobID,State >/dev/null 2>&1; then
            echo "check: sacct works"
        else
            echo "check: FAILED: sacct does not work"
            ok=0
        fi
    fi
    if ((ok)); then echo "check: OK"; else echo "check: FAILED"; fi
    ((ok))
}

cmd_fail() {
    local n=${1:-} mode=${2:-} wait=0 pid t0 a
    [[ -n $n && -n $mode ]] || die "usage: $PROG fail NODE crash|hang|slurmd|down|drain [--wait]"
    shift 2
    for a in "$@"; do
        case $a in
        --wait) wait=1 ;;
        *) die "unknown option $a" ;;
        esac
    done
    need_root
    load_state || die "not up"
    valid_node "$n"
    lock
    t0=$(now)
    case $mode in
    crash)
        node_kill "$n"
        log "$n: crashed (every process SIGKILLed)"
        ;;
    hang)
        node_freeze "$n"
        log "$n: frozen"
        ;;
    slurmd)
        pid=$(slurmd_pid "$n")
        [[ -n $pid ]] || die "$n: slurmd is not running"
        kill -KILL "$pid"
        log "$n: slurmd (PID $pid) SIGKILLed; its job tasks keep running"
        ;;
    down | drain)
        timeout 10 scontrol update nodename="$n" state="$mode" reason="$PROG fail" || die "scontrol update failed"
        log "$n: set to $mode"
        ;;
    *) die "mode must be crash, hang, slurmd, down or drain" ;;
    esac
    exec 9<&-
    if ((wait)); then
        local re='down.*'
        [[ $mode == drain ]] && re='drain.*|drng.*'
        wait_nodes "$re" "$n" "$WAIT_S" ||
            die "$n not marked $mode by Slurm after ${WAIT_S}s (state: $(timeout 10 sinfo -h -N -n "$n" -o %t))"
        log "$n: Slurm state $(timeout 10 sinfo -h -N -n "$n" -o %t) after $(since "$t0") s"
    fi
}

cmd_recover() {
    local n=${1:-} t0
    [[ -n $n ]] || die "usage: $PROG recover NODE"
    need_root
    load_state || die "not up"
    valid_node "$n"
    lock
    t0=$(now)
    node_thaw "$n"
    if [[ -z $(slurmd_pid "$n") ]]; then
        start_slurmd "$n"
        wait_slurmd "$n"
    fi
    exec 9<&-
    timeout 10 scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true
    wait_nodes 'idle|alloc|mix' "$n" "$WAIT_S" ||
        die "$n not back after ${WAIT_S}s (state: $(timeout 10 sinfo -h -N -n "$n" -o %t))"
    log "$n: recovered ($(timeout 10 sinfo -h -N -n "$n" -o %t)) in $(since "$t0") s"
}

cmd_nodes() {
    load_state || die "not up (no cluster in $DIR)"
    node_names
}

cmd_pids() {
    local n=${1:-}
    [[ -n $n ]] || die "usage: $PROG pids NODE"
    load_state || die "not up (no cluster in $DIR)"
    valid_node "$n"
    node_pids "$n"
}

usage() {
    sed -n '2,/^$/{s/^# \{0,1\}//;p}' "$SELF"
}

main() {
    local cmd=${1:-help}
    shift || true
    case $cmd in
    up) cmd_up "$@" ;;
    down) cmd_down "$@" ;;
    status) cmd_status "$@" ;;
    check) cmd_check "$@" ;;
    fail) cmd_fail "$@" ;;
    recover) cmd_recover "$@" ;;
    nodes) cmd_nodes "$@" ;;
    pids) cmd_pids "$@" ;;
    help | -h | --help) usage ;;
    *) usage >&2; exit 2 ;;
    esac
}

main "$@"
