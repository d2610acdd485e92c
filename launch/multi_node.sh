#!/usr/bin/env bash
# Several nodes, torchrun with a static rendezvous on MASTER_ADDR:MASTER_PORT.
# Run the same command on every node, changing only NODE_RANK (0 on the master node):
#
#   launch/multi_node.sh NNODES NODE_RANK MASTER_ADDR [args for python -m $MODULE ...]
#
# Environment:
#   MASTER_PORT      rendezvous port on the master (default 29500); the failure monitor also
#                    uses MASTER_PORT+1 on the master: open both in the firewall
#   NPROC_PER_NODE   processes (stages) per node (default 1: one GPU per node)
#   MODULE, PYTHON   as in single_node.sh
#   GLOO_SOCKET_IFNAME=eth1   network interface gloo uses (CPU stages); set it when the
#                    hostname resolves to 127.0.0.1 or to the wrong network
#   NCCL_SOCKET_IFNAME=ib0    the same for NCCL (GPU stages); NCCL_DEBUG=INFO shows its choice
set -euo pipefail

usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    echo "example (node 1 of 2): MASTER_PORT=29500 launch/multi_node.sh 2 1 10.0.0.1 --dummy-weights"
}

if [[ $# -ge 1 && ( "$1" == "-h" || "$1" == "--help" ) ]]; then
    usage
    exit 0
fi
if [[ $# -lt 3 ]]; then
    usage >&2
    exit 2
fi
NNODES=$1 NODE_RANK=$2 MASTER_ADDR=$3
shift 3
if ! [[ "$NNODES" =~ ^[1-9][0-9]*$ && "$NODE_RANK" =~ ^[0-9]+$ ]] || ((NODE_RANK >= NNODES)); then
    echo "multi_node.sh: need NNODES >= 1 and 0 <= NODE_RANK < NNODES, got '$NNODES' '$NODE_RANK'" >&2
    exit 2
fi

exec "${PYTHON:-python}" -m torch.distributed.run \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}" \
    --nproc-per-node "${NPROC_PER_NODE:-1}" \
    -m "${MODULE:-flexgen_dist.run}" "$@"
