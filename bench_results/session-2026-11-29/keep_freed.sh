#!/usr/bin/env bash
# Freed host memory kept for reuse (hugepages.keep_freed): the commit before against this tree.
set -e
D=bench_results/session-2026-11-29
J="--num-prompts 64 --prompt-len 512 --gen-len 32 --ignore-eos --print-outputs 0 --no-progress --hardware $D/profile-B.yaml"
python -m flexgen_dist.bench compare --rev a63aa3f --repeat 2 --json $D/compare-keep-freed-bf16.json -- $J --dtype bfloat16
python -m flexgen_dist.bench compare --rev a63aa3f --repeat 2 --json $D/compare-keep-freed-f32.json -- $J --dtype float32
python -m flexgen_dist.bench compare --rev a63aa3f --repeat 2 --json $D/compare-keep-freed-bf16-4bit.json -- $J --dtype bfloat16 --compress-weight
