#!/usr/bin/env bash
# One call on a lent GPU machine, within BUDGET seconds (default 555): the timed cases first, while
# nothing else runs (decode attention per backend, OPT-6.7B on the GPU, compressed, a profiled
# run), then the GPU-marked tests (TESTS=rest: the rest of the suite beside them), then the
# OPT-30B split case with the time left. (The third sitting measured the load stream against the
# compute stream; it is the default since, and this call no longer times the pair.) Each step leaves its JSON or .tar.gz in $OUT (OUT:
# where the files to bring back go; default ./gpu-out; at most 8 files).
#
#   flexgen_dist/bench/fetch_gpu_wheels.sh .whl          # first, where pip works (flexgen, gguf)
#   BUDGET=555 bash flexgen_dist/bench/gpu_call.sh        # on the GPU machine, from the repo root
#   PART=big BUDGET=555 bash flexgen_dist/bench/gpu_call.sh   # OPT-30B split alone, this engine then FlexGen
#
# docs/benchmarks.md, "GPU", says what each step measures and what the last calls found.
T0=$(date +%s); DEADLINE=$((T0 + ${BUDGET:-555}))
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
left() { echo $(( DEADLINE - $(date +%s) )); }
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi -L; nproc; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
S="python3 -m flexgen_dist.bench.gpu_suite"
if [ "${PART:-}" = big ]; then  # the cases that need a call of their own: OPT-30B split 20/80, both systems
    case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
        *H200*) HW=configs/hardware/h200.yaml ;; *H100*) HW=configs/hardware/h100.yaml ;; *) HW= ;;
    esac
    echo "## opt-30b split, this engine $(date +%T), $(left) s left"
    $S --out /tmp/b1 --phases compare ${HW:+--hardware "$HW"} --cases opt-30b-split --skip-flexgen --skip-auto \
        --skip-accelerate --timeout 240 --archive "$OUT/b1.tar.gz" 2>&1 | grep "^#"
    L=$(left); echo "## opt-30b split, FlexGen $(date +%T), $L s left"
    $S --out /tmp/b2 --phases compare --cases opt-30b-split --skip-ours --skip-auto --skip-accelerate \
        --timeout $(( L - 15 )) --archive "$OUT/b2.tar.gz" 2>&1 | grep "^#"
    echo "## end $(date +%T), $(left) s left"
    exit 0
fi
echo "## decode attention per backend $(date +%T), $(left) s left"
timeout 60 python3 -m flexgen_dist.bench.decode_attention --calls 24 --json "$OUT/decode-attention.json" 2>&1 | tail -16
echo "## profile + opt-6.7b on the GPU $(date +%T), $(left) s left"
$S --out /tmp/c --phases profile compare --cases opt-6.7b-gpu --also-random --extra-dtypes bfloat16 \
    --skip-accelerate --timeout 90 --archive "$OUT/c.tar.gz" 2>&1 | grep "^#"
HW=$(ls /tmp/c/*.yaml 2>/dev/null | head -1)
echo "## opt-6.7b compressed $(date +%T), $(left) s left"
$S --out /tmp/c3 --phases compare ${HW:+--hardware "$HW"} --cases opt-6.7b-gpu-compressed --skip-auto \
    --skip-accelerate --timeout 80 --archive "$OUT/c3.tar.gz" 2>&1 | grep "^#"
echo "## where a decode step's time goes, random weights $(date +%T), $(left) s left"
timeout 60 python3 -m flexgen_dist.bench.trace --json "$OUT/trace.json" -- --model opt-6.7b --dummy-weights \
    --num-prompts 128 --prompt-len 512 --gen-len 8 --ignore-eos --percent 100 0 100 0 100 0 --gpu-batch-size 32 \
    --num-gpu-batches 4 --no-cpu-attention --dtype float16 --warmup --no-progress --print-outputs 0 2>&1 | tail -14
echo "## tests: GPU-marked${TESTS:+ and $TESTS} $(date +%T), $(left) s left"
L=$(left); T=200; [ "$L" -lt 300 ] && T=$(( L - 100 )); [ "$T" -lt 60 ] && T=60
$S --out /tmp/tg --phases tests --tests gpu --workers 8 --timeout "$T" --archive "$OUT/tests-gpu.tar.gz" > /tmp/tg.out 2>&1 &
if [ "${TESTS:-}" = rest ]; then  # the rest of the suite too (it passed on the H100 but for the bundled model)
    $S --out /tmp/tr --phases tests --tests rest --workers 8 --timeout "$T" --archive "$OUT/tests-rest.tar.gz" > /tmp/tr.out 2>&1 &
fi
wait
grep -h '"summary"' /tmp/tg/tests.json /tmp/tr/tests.json 2>/dev/null
L=$(left); echo "## opt-30b split, this engine $(date +%T), $L s left"
if [ "$L" -gt 70 ]; then
    $S --out /tmp/c2 --phases compare ${HW:+--hardware "$HW"} --cases opt-30b-split --skip-flexgen --skip-auto \
        --skip-accelerate --timeout $(( L - 15 )) --archive "$OUT/c2.tar.gz" 2>&1 | grep "^#"
fi
L=$(left); echo "## opt-30b split, FlexGen $(date +%T), $L s left"
if [ "$L" -gt 90 ]; then
    $S --out /tmp/c4 --phases compare --cases opt-30b-split --skip-ours --skip-auto --skip-accelerate \
        --timeout $(( L - 15 )) --archive "$OUT/c4.tar.gz" 2>&1 | grep "^#"
fi
echo "## end $(date +%T), $(left) s left"
