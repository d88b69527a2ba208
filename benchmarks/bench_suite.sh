#!/usr/bin/env bash
# Wall time and CPU time of the README's test command: CPU is every process's (the machine's
# busy time from /proc/stat), since the tests' forked and spawned processes are not all
# reaped by the command. Run it on an otherwise idle machine; extra arguments go to pytest.
#   bash benchmarks/bench_suite.sh [LOG]
set -uo pipefail
cd "$(dirname "$0")/.."
log=${1:-/tmp/bench_suite.log}
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat; }
b0=$(busy); t0=$(date +%s.%N); l0=$(cut -d' ' -f1 /proc/loadavg)
python -m pytest tests -q -p no:cacheprovider -rs -n 2 --dist loadfile "${@:2}" > "$log" 2>&1; rc=$?
b1=$(busy); t1=$(date +%s.%N); l1=$(cut -d' ' -f1 /proc/loadavg)
tick=$(getconf CLK_TCK)
python3 -c "import sys; t0,t1,b0,b1,tick=map(float,sys.argv[1:6]); print(f'exit {sys.argv[6]}: wall {t1-t0:.1f} s, CPU {(b1-b0)/tick:.0f} s (all processes), load {sys.argv[7]} -> {sys.argv[8]}')" \
    "$t0" "$t1" "$b0" "$b1" "$tick" "$rc" "$l0" "$l1"
tail -1 "$log"
exit $rc
