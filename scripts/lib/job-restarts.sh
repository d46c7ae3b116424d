# Sourced by the multi-node job scripts (sbatch/*-multinode.sbatch), after they cd to the project.
#
#   srun_resuming RANKS_MULTIPLE SRUN_ARGS...
#
# runs the training as a job step (srun SRUN_ARGS...) and returns its exit status, except when a
# rank or a whole node stopped answering: the run then ends within --collective-timeout with exit
# 3 (its line names the rank and its host), and the job starts it again from its last checkpoint,
# at most MAX_RESTARTS times in all (default 2):
#
# - ON_NODE_LOSS=shrink (the default): in this same allocation, on the nodes that still answer
#   (each is asked to run a one-task step within PROBE_SECONDS, default 60). The scripts ask for
#   --no-kill so that Slurm leaves the job its other nodes when one fails, and the job does not
#   wait in the queue again. When nodes were lost, the run goes on with fewer ranks: the largest
#   number of the nodes left whose ranks are a multiple of RANKS_MULTIPLE (the layout's TP × PP,
#   or the pipeline's DP; 1 for data parallelism); the checkpoint reshards onto them, and the
#   global batch shrinks with the ranks (the batch per rank stays).
# - ON_NODE_LOSS=requeue, or no node left that fits: the job goes back in the queue (scontrol
#   requeue, allowed by --requeue), to start again with as many nodes as it asked for, on nodes
#   that are up.
#
# Slurm's restart count (SLURM_RESTART_COUNT) and this job's restarts in place count together.

srun_resuming() {
    local multiple="$1" rc=0 restarts=0 lost left k list
    shift
    local job="${SLURM_JOB_NAME:-job}" max="${MAX_RESTARTS:-2}" per
    per="$(tasks_per_node)"
    local nodes=() answering=()
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    srun "$@" || rc=$?
    while ((rc == 3)); do
        if ((restarts + ${SLURM_RESTART_COUNT:-0} >= max)); then
            echo "$job: a rank or node stopped answering; no restart left (MAX_RESTARTS=$max, ${SLURM_RESTART_COUNT:-0} requeue(s) and $restarts restart(s) in place made)" >&2
            return "$rc"
        fi
        mapfile -t answering < <(nodes_that_answer "${nodes[@]}")
        lost="$(comm -23 <(printf '%s\n' "${nodes[@]}" | sort) <(printf '%s\n' "${answering[@]}" | sort) | tr '\n' ' ')"
        # The most nodes left whose ranks fit the layout, in the allocation's order (the first
        # keeps the batch script and MASTER_ADDR).
        for ((k = ${#answering[@]}; k > 0; k--)); do ((k * per % multiple == 0)) && break; done
        if [[ "${ON_NODE_LOSS:-shrink}" == requeue ]] || ((k == 0)); then
            if ! scontrol show job -o "$SLURM_JOB_ID" | grep -q ' Requeue=1'; then
                echo "$job: a rank or node stopped answering${lost:+ (${lost% } lost)}; not requeued: the job was submitted with --no-requeue" >&2
                return "$rc"
            fi
            echo "$job: a rank or node stopped answering${lost:+ (${lost% } lost)}; requeueing job $SLURM_JOB_ID to resume from the last checkpoint on nodes that are up (restart $((restarts + ${SLURM_RESTART_COUNT:-0} + 1)) of at most $max)" >&2
            scontrol requeue "$SLURM_JOB_ID"
            exit 75
        fi
        restarts=$((restarts + 1))
        nodes=("${answering[@]:0:k}")
        list="$(IFS=,; echo "${nodes[*]}")"
        left=""
        ((k < ${#answering[@]})) && left=" (${#answering[@]} answer; $k × $per ranks is the most that is a multiple of $multiple)"
        echo "$job: a rank or node stopped answering${lost:+; lost: ${lost% }}; resuming from the last checkpoint on $k node(s), $((k * per)) ranks: ${nodes[*]}$left (restart $((restarts + ${SLURM_RESTART_COUNT:-0})) of at most $max)" >&2
        rc=0
        # --overlap: Slurm (22.05) keeps the failed step's CPUs booked until the dead node answers,
        # which it never does; the new step shares them (nothing runs there any more).
        srun --overlap --nodes="$k" --nodelist="$list" --ntasks="$((k * per))" --ntasks-per-node="$per" "$@" || rc=$?
    done
    return "$rc"
}

# The tasks per node the job asked for (SLURM_TASKS_PER_NODE reads like "4(x2)" or "4,3").
tasks_per_node() {
    local t="${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-1}}"
    t="${t%%[(,]*}"
    echo "${t:-1}"
}

# nodes_that_answer NODE...: those of NODE... on which a one-task step runs within PROBE_SECONDS,
# all asked at once, in the order given.
nodes_that_answer() {
    local i pids=()
    for i in "$@"; do
        timeout "${PROBE_SECONDS:-60}" srun --overlap --mpi=none --nodes=1 --ntasks=1 --cpus-per-task=1 --nodelist="$i" true >/dev/null 2>&1 &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        if wait "${pids[$i]}"; then
            local all=("$@")
            echo "${all[$i]}"
        fi
    done
}
