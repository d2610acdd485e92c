#!/usr/bin/env bash
# The run's own prediction beside its measurement: the commit before (A, profile version 6) and
# this one (B, version 7: decode_flops, cpu_att_read, a cold-cache cpu_att_peak), each with a
# profile its own profiler measured minutes apart, runs alternating.
set -e
D=$PWD/bench_results/session-2026-11-29
A=${A:-/tmp/s19/head}
COMMON="--num-prompts 64 --prompt-len 512 --gen-len 32 --ignore-eos --offload-dir /tmp/off1 --print-outputs 0 --no-progress"
(cd $A && python -m flexgen_dist.planner profile --device cpu --out $D/profile-A.yaml > /dev/null)  # run in its tree: its code
python -m flexgen_dist.planner profile --device cpu --out $D/profile-B.yaml > /dev/null
for r in 1 2; do
  for d in bfloat16 float32; do
    (cd $A && python -m flexgen_dist.run --dtype $d $COMMON --hardware $D/profile-A.yaml --metrics $D/pred-A-$d-$r.json)
    python -m flexgen_dist.run --dtype $d $COMMON --hardware $D/profile-B.yaml --metrics $D/pred-B-$d-$r.json
  done
done
D=$D python - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.environ["D"] + "/pred-*.json")):
    m = json.load(open(f)); p = m["predicted"]
    print(f"{f.split('/')[-1]:26s} measured decode {m['decode_throughput']:6.1f} total {m['total_throughput']:5.1f} | "
          f"predicted decode {p['decode_throughput']:6.1f} ({p['decode_throughput'] / m['decode_throughput']:.2f}x) "
          f"total {p['total_throughput']:5.1f} ({p['total_throughput'] / m['total_throughput']:.2f}x)")
PY
