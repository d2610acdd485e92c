#!/usr/bin/env bash
# The run's own prediction beside its measurement, one profile with and without its new figures.
set -e
D=bench_results/session-2026-11-28h
COMMON="--num-prompts 64 --prompt-len 512 --gen-len 32 --ignore-eos --offload-dir /tmp/off1 --print-outputs 0 --no-progress"
for p in v6 v6-without-peak; do
  python -m flexgen_dist.run --dtype bfloat16 $COMMON --hardware $D/vm-cpu-profile-$p.yaml --metrics $D/pred-bf16-$p.json
  python -m flexgen_dist.run $COMMON --hardware $D/vm-cpu-profile-$p.yaml --metrics $D/pred-f32-$p.json
done
for p in v6 v6-without-peak v6-without-peak-or-packed; do
  python -m flexgen_dist.run --dtype bfloat16 --compress-cache --percent 100 0 0 100 100 0 --gpu-batch-size 32 \
    --num-gpu-batches 2 $COMMON --hardware $D/vm-cpu-profile-$p.yaml --metrics $D/pred-bf16-4bit-cache-$p.json
done
