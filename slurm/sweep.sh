#!/usr/bin/env bash
# Scaling sweep: submit slurm/run.sbatch once per node count, each with its own Slurm
# log, metrics and output names.
#
#   slurm/sweep.sh [-o OUTDIR] NODES... [-- args for python -m $MODULE ...]
#   slurm/sweep.sh 1 2 4 -- --dummy-weights --model opt-30b --gen-len 32
#
# Writes OUTDIR/run-{N}n-%j.out (Slurm's log) and passes --metrics OUTDIR/metrics-{N}n.json
# and --output OUTDIR/out-{N}n.jsonl to the run (OUTDIR default: sweep-<date>). Set
# SWEEP_NO_METRICS=1 to pass neither (e.g. for MODULE=flexgen_dist.distributed.check).
# SBATCH_ARGS adds sbatch options to every submission, e.g. "--partition=gpu --gpus-per-task=1".
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

OUTDIR="sweep-$(date +%Y%m%d-%H%M%S)"
nodes=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        -o) OUTDIR=$2; shift 2 ;;
        --) shift; break ;;
        *)
            if ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
                echo "sweep.sh: node counts must be positive integers, got '$1'" >&2
                exit 2
            fi
            nodes+=("$1"); shift ;;
    esac
done
if [[ ${#nodes[@]} -eq 0 ]]; then
    usage >&2
    exit 2
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$OUTDIR"
# shellcheck disable=SC2206  # SBATCH_ARGS is split on purpose
extra=(${SBATCH_ARGS:-})
for n in "${nodes[@]}"; do
    run_args=()
    if [[ -z "${SWEEP_NO_METRICS:-}" ]]; then
        run_args=(--metrics "$OUTDIR/metrics-${n}n.json" --output "$OUTDIR/out-${n}n.jsonl")
    fi
    sbatch --parsable --nodes="$n" --ntasks-per-node=1 --job-name="flexgen-${n}n" \
        --output="$OUTDIR/run-${n}n-%j.out" "${extra[@]}" \
        "$here/run.sbatch" "${run_args[@]}" "$@"
done
