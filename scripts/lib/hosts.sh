# Several hosts on one machine (sourced, not run): each host is a Linux network namespace with
# its own address on a bridge, its own loopback, its own /etc/hosts (every host by name) and, for
# every process started on it with `on_host`, its own UTS namespace named after it, so that
# `hostname` says node1, node2, ... Used by scripts/test-cluster (Slurm across the hosts) and
# scripts/test-two-hosts (make test's cross-host launch check). Needs root and iproute2.
#
#   hosts_up PREFIX N        creates node1..nodeN (and `head`, the submit and controller host)
#   on_host NAME CMD...      runs CMD on host NAME (node1.., head), in the foreground
#   link_rate NAME RATE      shapes NAME's link to RATE (tc tbf, both directions), e.g. 1gbit
#   link_down NAME           takes NAME's link down (its processes stay, its packets go nowhere)
#   link_up NAME             brings it back
#   host_dies NAME           SIGKILLs every process on NAME
#   host_pids NAME PATTERN   the processes on NAME whose command line has PATTERN
#   hosts_down               stops every process on the hosts, removes namespaces and bridge
#   hosts_left               prints what of this run is still there (nothing when clean)
#
# Names are this run's own (PREFIX, at most 6 characters, in every namespace and link name), so
# that two runs on one machine do not meet; the addresses are 10.HOSTS_NET.0.0/24 (HOSTS_NET is
# 77 unless set), node K at .K and head at .254, on a bridge that only this run's hosts use (the
# machine's own namespace gets no address on it, so nothing of the machine is reachable from the
# hosts and no port is taken there).

hosts_prefix=""
hosts_count=0
hosts_net="${HOSTS_NET:-77}"

# hosts_ns NAME: the namespace of host NAME.
hosts_ns() { printf '%s%s' "$hosts_prefix" "$1"; }
# hosts_addr NAME: its address.
hosts_addr() {
    case "$1" in
        head) echo "10.$hosts_net.0.254" ;;
        node*) echo "10.$hosts_net.0.${1#node}" ;;
        *) return 1 ;;
    esac
}
hosts_names() {
    local i
    echo head
    for ((i = 1; i <= hosts_count; i++)); do echo "node$i"; done
}

hosts_can() {
    [[ $(id -u) == 0 ]] || { echo "needs root (network namespaces)"; return 1; }
    command -v ip >/dev/null || { echo "needs iproute2's ip"; return 1; }
    command -v unshare >/dev/null && command -v nsenter >/dev/null || { echo "needs util-linux's unshare and nsenter"; return 1; }
    local probe="hp$$"
    ip netns add "$probe" 2>/dev/null || { echo "this machine cannot make network namespaces (ip netns add failed)"; return 1; }
    # What on_host does: join the namespace, then a mount and a UTS namespace of its own.
    if ! nsenter --net="/run/netns/$probe" unshare --uts --mount sh -c 'mount --bind /etc/hosts /etc/hosts && hostname probe' 2>/dev/null; then
        ip netns del "$probe"
        echo "this machine cannot give a process its own mounts and host name (unshare --uts --mount, mount --bind failed)"
        return 1
    fi
    ip netns del "$probe"
    ip link add "${probe}b" type bridge 2>/dev/null || { echo "this machine cannot make a bridge (ip link add type bridge failed)"; return 1; }
    ip link del "${probe}b"
}

hosts_up() {
    hosts_prefix="$1" hosts_count="$2"
    local br="${hosts_prefix}br" name ns veth
    ip link add "$br" type bridge
    ip link set "$br" up
    for name in $(hosts_names); do
        ns="$(hosts_ns "$name")"
        veth="${hosts_prefix}${name#node}"  # the machine's end: PREFIX1, PREFIX2, ..., PREFIXhead
        ip netns add "$ns"
        ip link add "$veth" type veth peer name eth0 netns "$ns"
        ip link set "$veth" master "$br" up
        ip -n "$ns" addr add "$(hosts_addr "$name")/24" dev eth0
        ip -n "$ns" link set lo up
        ip -n "$ns" link set eth0 up
        # on_host mounts it over /etc/hosts (as `ip netns exec` would): hosts know each other by name.
        mkdir -p "/etc/netns/$ns"
        {
            printf '127.0.0.1\tlocalhost\n'
            local other
            for other in $(hosts_names); do printf '%s\t%s\n' "$(hosts_addr "$other")" "$other"; done
        } >"/etc/netns/$ns/hosts"
    done
}

# Not `ip netns exec`: it mounts a sysfs of the namespace's own over /sys, which hides
# /sys/fs/cgroup, and slurmd will not start without it. nsenter joins the network namespace; a
# mount namespace of the process's own gets the host's /etc/hosts; a UTS namespace its name.
# With HOSTS_PRIVATE_TMP=DIR, each node's /tmp is DIR/NAME, node-local as on a cluster (Slurm's
# PMIx plugin, for one, keeps a job step's files under /tmp by a name every node uses).
on_host() {
    local name="$1" ns tmp=""; shift
    ns="$(hosts_ns "$name")"
    [[ -n "${HOSTS_PRIVATE_TMP:-}" && "$name" == node* ]] && { tmp="$HOSTS_PRIVATE_TMP/$name"; mkdir -p "$tmp"; chmod 1777 "$tmp"; }
    nsenter --net="/run/netns/$ns" unshare --uts --mount sh -c \
        'mount --bind "$1" /etc/hosts && { [ -z "$2" ] || mount --bind "$2" /tmp; } && hostname "$0" && shift 2 && exec "$@"' \
        "$name" "/etc/netns/$ns/hosts" "$tmp" "$@"
}

# The machine's end of a host's link (traffic to the host leaves the bridge there) and the
# host's own end (traffic from it): shaping both limits each direction.
link_rate() {
    local name="$1" rate="$2" veth="${hosts_prefix}${1#node}"
    # A burst of at least rate/HZ (here rate/250 bytes) keeps tbf from throttling below its rate.
    local q=(root tbf rate "$rate" burst 256kb latency 100ms)
    tc qdisc replace dev "$veth" "${q[@]}"
    ip netns exec "$(hosts_ns "$name")" tc qdisc replace dev eth0 "${q[@]}"
}

link_down() { ip -n "$(hosts_ns "$1")" link set eth0 down; }
link_up() { ip -n "$(hosts_ns "$1")" link set eth0 up; }

# host_pids NAME PATTERN: the processes on host NAME whose command line has PATTERN.
host_pids() {
    local pid
    for pid in $(ip netns pids "$(hosts_ns "$1")" 2>/dev/null); do
        tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$2" && echo "$pid"
    done
    return 0
}

# host_dies NAME: every process on host NAME is SIGKILLed at once (its daemons too), as when a
# node loses power; its address stays, with nothing behind it.
host_dies() {
    local pids
    pids="$(ip netns pids "$(hosts_ns "$1")" 2>/dev/null || true)"
    [[ -z "$pids" ]] || kill -KILL $pids 2>/dev/null || true
}

hosts_kill_all() {
    local name ns pids
    for name in $(hosts_names); do
        ns="$(hosts_ns "$name")"
        ip netns list 2>/dev/null | grep -qw "^$ns" || continue
        pids="$(ip netns pids "$ns" 2>/dev/null || true)"
        [[ -n "$pids" ]] && kill -"${1:-TERM}" $pids 2>/dev/null || true
    done
}

hosts_down() {
    [[ -n "$hosts_prefix" ]] || return 0
    local name ns left i
    hosts_kill_all TERM
    for i in $(seq 20); do
        left=""
        for name in $(hosts_names); do left+="$(ip netns pids "$(hosts_ns "$name")" 2>/dev/null || true)"; done
        [[ -z "$left" ]] && break
        sleep 0.25
    done
    hosts_kill_all KILL
    for name in $(hosts_names); do
        ns="$(hosts_ns "$name")"
        ip netns del "$ns" 2>/dev/null || true
        rm -rf "/etc/netns/$ns"
    done
    ip link del "${hosts_prefix}br" 2>/dev/null || true
}

hosts_left() {
    [[ -n "$hosts_prefix" ]] || return 0
    local name ns
    for name in $(hosts_names); do
        ns="$(hosts_ns "$name")"
        ip netns list 2>/dev/null | grep -qw "^$ns" && echo "namespace $ns"
        [[ -e "/etc/netns/$ns" ]] && echo "/etc/netns/$ns"
    done
    ip link show "${hosts_prefix}br" >/dev/null 2>&1 && echo "bridge ${hosts_prefix}br"
    return 0
}
