#!/usr/bin/env bash
# One node, NPROC processes (one pipeline stage each), torchrun's standalone rendezvous.
#
#   launch/single_node.sh NPROC [args for python -m $MODULE ...]
#
# Environment:
#   MODULE   python module to run (default flexgen_dist.run; flexgen_dist.distributed.check is the
#            communication self-check)
#   PYTHON   interpreter (default python); torchrun is run as `$PYTHON -m torch.distributed.run`
#            so it always matches the interpreter that has flexgen_dist installed
set -euo pipefail

usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    echo "example: launch/single_node.sh 2 --dummy-weights --model opt-1.3b --num-micro-batches 2"
}

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    usage
    [[ $# -ge 1 ]] && exit 0 || exit 2
fi
NPROC=$1
shift
if ! [[ "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
    echo "single_node.sh: NPROC must be a positive integer, got '$NPROC'" >&2
    exit 2
fi

exec "${PYTHON:-python}" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    -m "${MODULE:-flexgen_dist.run}" "$@"
