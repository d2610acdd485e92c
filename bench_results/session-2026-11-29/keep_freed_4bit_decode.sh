#!/usr/bin/env bash
# bfloat16 + 4-bit weights, decode-heavy job: freed memory kept (default) against FLEXGEN_KEEP_FREED=0,
# the same tree, alternating, three rounds each.
D=bench_results/session-2026-11-29
J="--num-prompts 64 --prompt-len 128 --gen-len 64 --ignore-eos --print-outputs 0 --no-progress --dtype bfloat16 --compress-weight --hardware $D/profile-B.yaml"
for r in 1 2 3; do
  for k in 0 1; do
    FLEXGEN_KEEP_FREED=$k python -m flexgen_dist.run $J --warmup --metrics $D/keep-freed-4bit-decode-k$k-r$r.json 2>&1 | grep -E "^prefill" | sed "s/^/keep_freed=$k round $r: /"
  done
done
