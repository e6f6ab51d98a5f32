#!/usr/bin/env bash
# axon's CUDA checks in one go, for a CUDA machine without network (see benchmarks/README.md, "GPU"):
# install the carried wheels, report the machine, run tests/gpu, then benchmarks/gpu/bench_cuda.py.
# Run from the repository root, with .whl/ and .gpu_assets/ (benchmarks/gpu/fetch_wheels.sh) beside it.
# Every phase has its own time limit (the whole script ends within ~8 minutes even if one hangs),
# and a failed phase does not stop the next. Everything goes to $OUT/gpu_run.log as well.
#
#   OUT=/some/dir bash benchmarks/gpu/run.sh     # OUT defaults to ./gpu_out
#
# A dry run without CUDA (tests skip, the benchmark on the CPU with a tiny model):
#   AXON_GPU_BENCH_ARGS="--device cpu --tiny --runs 1" bash benchmarks/gpu/run.sh
set -u -o pipefail
cd "$(dirname "$0")/../.."

OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
LOG=$OUT/gpu_run.log
: >"$LOG"
SITE=${AXON_GPU_SITE:-/tmp/site}
TESTS_S=${AXON_GPU_TESTS_S:-200}
BENCH_S=${AXON_GPU_BENCH_S:-220}
# No phase runs past this many seconds from the start, whatever the phases' own limits say.
DEADLINE=${AXON_GPU_TOTAL_S:-470}

export PYTHONUNBUFFERED=1
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
export AXON_CACHE_ROOT=${AXON_CACHE_ROOT:-$(mktemp -d /tmp/axon-cache-XXXXXX)}
export TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

status=0
phase() {  # phase NAME SECONDS COMMAND...: run under a time limit, log its exit status, go on
    local name=$1 limit=$2
    shift 2
    local left=$((DEADLINE - SECONDS - 12))  # 12 s: timeout's --kill-after and the last lines
    if ((left < 5)); then
        echo "=== $name: SKIPPED, the ${DEADLINE} s budget is spent" | tee -a "$LOG"
        status=1
        return
    fi
    ((limit > left)) && limit=$left
    echo "=== $name (limit ${limit} s) $(date -u +%H:%M:%S)" | tee -a "$LOG"
    local start=$SECONDS
    timeout --kill-after=8 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc$([[ $rc == 124 || $rc == 137 ]] && echo ' (time limit)') in $((SECONDS - start)) s" \
        | tee -a "$LOG"
    [[ $rc == 0 ]] || status=1
}

phase "install wheels into $SITE" 45 python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
phase "machine" 20 nvidia-smi -L
phase "versions" 45 python3 -c 'import sys, importlib.metadata as md, torch, axon
import axon.entrypoints.openai.api_server, xgrammar, openai  # the server and test imports resolve
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), "| axon from", axon.__file__)
names = "transformers tokenizers xgrammar fastapi starlette uvicorn pydantic openai httpx msgspec pyzmq"
print(" | ".join(f"{n} {md.version(n)}" for n in names.split()))'

timeout_flag=()
if python3 -c "import pytest_timeout" 2>/dev/null; then timeout_flag=(--timeout=120); fi
# --maxfail=3, not -x: one run on the machine should show every independent failure it can.
phase "tests/gpu" "$TESTS_S" python3 -m pytest -q tests/gpu --maxfail=3 -p no:cacheprovider --durations=0 \
    "${timeout_flag[@]}"
phase "device memory before the benchmark" 20 nvidia-smi --query-gpu=memory.used,memory.total --format=csv
# shellcheck disable=SC2086  # AXON_GPU_BENCH_ARGS: extra flags, word-split on purpose
phase "benchmark" "$BENCH_S" python3 benchmarks/gpu/bench_cuda.py --json "$OUT/bench_cuda.json" \
    ${AXON_GPU_BENCH_ARGS:-}

echo "=== done: $([[ $status == 0 ]] && echo 'every phase passed' || echo 'some phase FAILED, see above'); log: $LOG" \
    | tee -a "$LOG"
exit $status
