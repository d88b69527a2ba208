#!/usr/bin/env bash
# The GPU checks in one call: the GPU tests (tests/test_gpu_async.py and
# tests/test_staging_safety.py, NCCL world 1 included, <= 240 s),
# benchmarks/bench_gpu_transport.py (transport of 1 GiB of GPU state over gloo at world 2 on
# the one GPU, <= 90 s), then benchmarks/bench_gpu.py on 2 GiB of GPU state (<= 210 s). Both
# benchmarks write their JSON as they go, so a timeout still leaves figures. Expected ~5-6
# minutes; at most 540 s (the sum of the timeouts).
#
#   bash benchmarks/gpu_check.sh                        # on the GPU machine
#   BENCH_ARGS=--dry-run bash benchmarks/gpu_check.sh   # anywhere: checks the script (GPU tests skip)
#
# Results go to $OUT when it is set (the device tool brings that folder back), else to
# benchmarks/results/: env.txt (GPU, driver, torch, scratch disk), pytest_gpu.log,
# bench_gpu_transport.log, gpu_transport.json, bench_gpu.log, gpu.json. Exit status: 0 when
# every step succeeded. TRANSPORT_ARGS replaces bench_gpu_transport.py's arguments (a dry
# run when BENCH_ARGS asks for one).
set -u -o pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-benchmarks/results}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# No network there: the test session's Megatron-Core peers (tests/peers.py) cannot be
# installed, and none of these tests needs them; make pip fail at once instead of retrying.
export PIP_NO_INDEX=1

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$PY" -c "import sys, torch, numpy, xxhash; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| cuda', torch.version.cuda, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA')"
    df -hT . ..
    nproc
    free -g
} >"$RESULTS/env.txt" 2>&1
cat "$RESULTS/env.txt"

status=0
timeout 240 "$PY" -m pytest tests/test_gpu_async.py tests/test_staging_safety.py -q -p no:cacheprovider -rs --durations=8 2>&1 | tee "$RESULTS/pytest_gpu.log" || status=1
if [[ "${BENCH_ARGS:-}" == *--dry-run* ]]; then DEFAULT_TRANSPORT_ARGS=--dry-run; else DEFAULT_TRANSPORT_ARGS="--size-mib 1024 --rounds 5"; fi
# shellcheck disable=SC2086 - TRANSPORT_ARGS and BENCH_ARGS are lists of arguments
timeout 90 "$PY" benchmarks/bench_gpu_transport.py ${TRANSPORT_ARGS:-$DEFAULT_TRANSPORT_ARGS} --out "$RESULTS/gpu_transport.json" 2>&1 |
    tee "$RESULTS/bench_gpu_transport.log" || status=1
# shellcheck disable=SC2086
timeout 210 "$PY" benchmarks/bench_gpu.py ${BENCH_ARGS:---size-gib 2 --rounds 5 --pinned-extra-gib 16} --out "$RESULTS/gpu.json" 2>&1 |
    tee "$RESULTS/bench_gpu.log" || status=1
echo "gpu_check: exit status $status (results in $RESULTS)"
exit $status
