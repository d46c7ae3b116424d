# A test Slurm's common parts (sourced, not run), for scripts/test-slurm (one node) and
# scripts/test-cluster (several hosts): Debian's packages, a munge of its own, and the
# slurm.conf lines both clusters share. The caller defines say() and die().

# slurm_install: slurm-wlm and munge from Debian with apt-get, skipped when already there.
slurm_install() {
    local need=() pkg
    for pkg in slurm-wlm munge "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || need+=("$pkg")
    done
    if ((${#need[@]})); then
        say "installing ${need[*]} with apt-get"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq "${need[@]}" >/dev/null
    else
        say "slurm-wlm $(dpkg-query -W -f='${Version}' slurm-wlm) and munge already installed"
    fi
}

# munge_start STATE: munged with a key of its own (the system's is left alone) and its socket
# under STATE/munge, its pid in STATE/run/munged.pid; prints the socket's path. A Unix socket
# is a file: every host's namespaces reach it.
munge_start() {
    local state="$1" sock="$1/munge/munge.socket"
    mkdir -p "$state/munge" "$state/run"
    mungekey --create --keyfile="$state/munge/munge.key" --force >/dev/null 2>&1 \
        || dd if=/dev/urandom of="$state/munge/munge.key" bs=1 count=1024 status=none
    chown -R munge:munge "$state/munge"
    chmod 700 "$state/munge"
    chmod 400 "$state/munge/munge.key"
    runuser -u munge -- munged --key-file="$state/munge/munge.key" --socket="$sock" \
        --pid-file="$state/munge/munged.pid" --log-file="$state/munge/munged.log" \
        --seed-file="$state/munge/munged.seed" --force
    local _
    for _ in $(seq 50); do [[ -S "$sock" ]] && break; sleep 0.1; done
    [[ -S "$sock" ]] || die "munged did not start: $(cat "$state/munge/munged.log" 2>/dev/null)"
    cp "$state/munge/munged.pid" "$state/run/munged.pid"
    munge --socket="$sock" -n | unmunge --socket="$sock" >/dev/null || die "munge does not round-trip"
    echo "$sock"
}

# slurm_conf_common STATE MUNGE_SOCKET: the lines every test cluster has: munge, root as
# Slurm's user, no accounting, no cgroup constraints (proctrack/linuxproc, task/none),
# consumable cores, jobs kept an hour for scontrol.
slurm_conf_common() {
    cat <<EOF2
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$2
CredType=cred/munge
StateSaveLocation=$1/spool/ctld
SlurmctldPidFile=$1/run/slurmctld.pid
SlurmctldLogFile=$1/log/slurmctld.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=3600
EOF2
    cat >"$1/etc/cgroup.conf" <<EOF2
# Generated for a test cluster: no cgroup requirement (proctrack/linuxproc, task/none);
# slurmd still loads a cgroup plugin at start-up: autodetected, and nothing is constrained.
IgnoreSystemd=yes
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF2
}

# slurm_stop_daemons STATE PID...: every daemon whose pid file is under STATE/run, and PIDs.
slurm_stop_daemons() {
    local state="$1" f p; shift
    for f in "$state"/run/*.pid; do
        [[ -f "$f" ]] || continue
        p="$(cat "$f" 2>/dev/null || true)"
        [[ -n "$p" ]] && kill "$p" 2>/dev/null || true
    done
    for p in "$@"; do kill "$p" 2>/dev/null || true; done
    sleep 1
    for p in "$@"; do kill -9 "$p" 2>/dev/null || true; done
}
