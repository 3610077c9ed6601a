# Sourced by torchrun.sbatch and deepspeed.sbatch, from the repository root; not a job script itself.
# Usage of both: RUN_DIR=/shared/runs/NAME sbatch [--nodes N --gpus-per-node G] launch/slurm/<launcher>.sbatch \
#                    CONFIG [key.path=value ...]

# The run directory must be on a filesystem every node mounts (NFS, Lustre, GPFS...): every rank
# writes its part of each checkpoint there, every rank reads all of them when the run resumes, and
# rank 0 writes the config, metrics and heartbeats the hang watchdog reads.
: "${RUN_DIR:?set RUN_DIR to the run directory, on a filesystem that every node mounts}"
CONFIG=${1:?usage: RUN_DIR=... sbatch launch/slurm/<launcher>.sbatch CONFIG [key.path=value ...]}
shift
# `run.resume: auto` continues from the newest complete checkpoint in RUN_DIR: the same script serves
# the first start, a requeue and a resubmission with another node count (other world sizes resume
# through DeepSpeed's universal checkpoint, with the data readers re-sharded).
OVERRIDES=("$@" "run.output_dir=$RUN_DIR" "run.resume=auto")

# Node 0 (SLURM_NODEID 0, the first host of the allocation's node list) holds ranks 0..G-1 and the
# rendezvous; ranks are numbered node after node, which `group_size: auto` relies on (and checks).
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${HOSTS[0]}
NNODES=${#HOSTS[@]}
# One port per job, so two jobs that share a first node do not collide.
PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
MAX_REQUEUES=${MAX_REQUEUES:-3}
EXITS="$RUN_DIR/slurm/exits-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"
mkdir -p "$EXITS"
export HEAD NNODES PORT GPUS_PER_NODE EXITS

# NCCL and collective settings (every node gets this environment through srun).
# Which network interface NCCL's bootstrap and socket transport use; set it when nodes have several
# (an `^` excludes: "^lo,docker0"), e.g. the InfiniBand IPoIB or the fast Ethernet interface.
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker0}
# InfiniBand: NCCL finds the HCAs itself; name them to pin the ports (e.g. mlx5_0,mlx5_1), or set
# NCCL_IB_DISABLE=1 on clusters without InfiniBand/RoCE so NCCL does not probe for it.
# export NCCL_IB_HCA=mlx5_0,mlx5_1
# export NCCL_IB_DISABLE=1
# Warnings only: INFO prints every ring and channel of every rank.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# A collective that fails or times out tears its process down, so the launcher sees a dead rank and
# the job ends, instead of the other ranks waiting forever.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# No process-group timeout to set: mmpt gives its groups one above train.watchdog_timeout itself, so a hang
# ends with the watchdog's report of every rank's step and exit code 75, not an anonymous collective timeout.
export PYTHONUNBUFFERED=1

# Runs the command string $1 once on every node (one srun task per node); the string is expanded on
# the node, so it can use $SLURM_NODEID. Each node leaves its exit code in $EXITS/<node id>. When one
# node fails, srun ends the others instead of leaving them blocked in a collective. The task gets all
# of the node's CPUs: a step's task is otherwise bound to one CPU, which the launcher's processes and
# their data-loader workers would all share.
on_every_node() {
    srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
        ${SLURM_CPUS_ON_NODE:+--cpus-per-task="$SLURM_CPUS_ON_NODE"} \
        bash -c "$1"'; code=$?; echo "$code" > "$EXITS/$SLURM_NODEID"; exit "$code"' node "${@:2}"
}

# The nodes an unhealthy-rank stop named (`train.on_unhealthy: stop`, exit 76), comma-separated, or nothing.
# mmpt writes $RUN_DIR/unhealthy.json when it names a rank; only a report of a stop counts, and it is moved
# to $RUN_DIR/slurm/ once read, so a later failure is not blamed on the same node again.
unhealthy_nodes() {
    local report="$RUN_DIR/unhealthy.json"
    [[ -f $report ]] || return 0
    python -c 'import json, sys
report = json.load(open(sys.argv[1]))
print(",".join(report["nodes"]) if report.get("action") == "stop" else "")' "$report" &&
        mv "$report" "$RUN_DIR/slurm/unhealthy-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}.json"
}

# Requeue the job held, add $1 (comma-separated nodes) to the nodes it excludes (every node excluded so far,
# kept in $RUN_DIR/slurm/excluded_nodes), and release it: it restarts on other nodes.
requeue_without() {
    local excluded="$RUN_DIR/slurm/excluded_nodes"
    tr ',' '\n' <<< "$1" >> "$excluded"
    local nodes
    nodes=$(sort -u "$excluded" | grep -v '^$' | paste -sd, -)
    echo "mmpt-slurm: requeueing job $SLURM_JOB_ID without node(s) $nodes (unhealthy rank; see $RUN_DIR/slurm)"
    scontrol requeuehold "$SLURM_JOB_ID"
    scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$nodes"
    scontrol release "$SLURM_JOB_ID"
    exit 0
}

# Requeue (the job goes back to the queue with the same id and resumes from its latest checkpoint) when
# the exit codes say a restart can help, at most MAX_REQUEUES times; `#SBATCH --requeue` allows it.
# A run that stopped on an unhealthy rank (exit 76; with torchrun, whose code is 1, its report) is requeued
# without that rank's node. $1: the exit codes that must not be retried (a rerun would stop the same way).
requeue_or_exit() {
    local final=0 code node
    for ((node = 0; node < NNODES; node++)); do
        code=$(cat "$EXITS/$node" 2>/dev/null || echo lost)  # no code: the node was stopped or lost
        echo "mmpt-slurm: node $node (${HOSTS[$node]}): exit $code"
        if [[ " $1 " == *" $code "* ]]; then
            echo "mmpt-slurm: not requeued: exit $code on node $node does not go away with a restart"
            exit "$code"
        fi
        [[ $code == 0 ]] || final=1
    done
    if ((final == 0)); then
        exit 0
    fi
    if ((${SLURM_RESTART_COUNT:-0} >= MAX_REQUEUES)); then
        echo "mmpt-slurm: not requeued: already restarted ${SLURM_RESTART_COUNT:-0} times (MAX_REQUEUES=$MAX_REQUEUES)"
        exit 1
    fi
    local unhealthy
    unhealthy=$(unhealthy_nodes)
    if [[ -n $unhealthy ]]; then
        requeue_without "$unhealthy"
    fi
    echo "mmpt-slurm: requeueing job $SLURM_JOB_ID; it resumes from the latest checkpoint in $RUN_DIR"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
}
