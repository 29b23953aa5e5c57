#!/usr/bin/env bash
# Issue 29 at 8 ranks on the lent 16-core machine: where DataParallel's / stage 0's step time goes
# (0.64-0.66 of the plain loop on 2026-11-28 16:34, stages 1-2 0.89-0.93, DDP over gloo 0.83), as
# one prepared call of the device tool (carry [".whl"]; see device16.sh for the wheel):
#
#   bash tests/perf/device_train8.sh 2>&1 | tee $OUT/train8.log
#
#   cpu    the machine: cores, threads per core, caches (lscpu)
#   trace  bench train dp and stage 2 with [log] trace_file; tests/perf/op_skew splits each
#          collective into the ranks' arrival spread and the op once all are in it
#   alone  all_reduce 4-32 MiB at 8 ranks alone (one thread a rank), slots of 4 and 16 MiB, and gloo
#   train  bench train: DataParallel and stage 0 with 25 (default) and 4 MiB buckets, stage 2, DDP
#   slot   bench train dp, stage 0 with [comm] shm_slot_bytes = 16 MiB
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
root=$PWD
OUT=${OUT:-/tmp/device_train8}; mkdir -p "$OUT"
. tests/perf/device_env.sh
SECTIONS=${SECTIONS:-cpu trace alone train slot}
t0=$(date +%s); budget=${BUDGET_S:-330}
left() { echo $(( budget - ($(date +%s) - t0) )); }
want() {
    case " $SECTIONS " in *" $1 "*) ;; *) return 1 ;; esac
    if [ "$(left)" -lt "$2" ]; then echo "== $1: skipped, $(left) s left"; return 1; fi
    echo "== $1 ($(date -u +%T), $(left) s left)"
}
model=(--dim 384 --layers 4 --steps 6 --warmup 2)
git log --oneline -1 2>/dev/null

if want cpu 5; then
    lscpu | grep -E '^(CPU\(s\)|Thread|Core|Socket|Model name|L1d|L2|L3|NUMA node\(s\))' || nproc
fi
if want trace 60; then
    rm -rf /tmp/tr; mkdir -p /tmp/tr
    grep '^cpu ' /proc/stat  # user nice system idle iowait irq softirq steal: steal before and after
    COMMRT_LOG_TRACE_FILE=/tmp/tr/t.json timeout 120 "$PY" -m commrt.cli bench train -n 8 --stages dp,2 --peers '' \
        "${model[@]}" --rounds 1 || echo "trace run failed ($?)"
    grep '^cpu ' /proc/stat
    "$PY" -m tests.perf.op_skew /tmp/tr/t.json --min-bytes 65536 --arrivals all_reduce:26020000 || echo "op_skew failed ($?)"
fi
if want alone 50; then
    for slot in 4194304 16777216; do
        echo "-- shm_slot_bytes $slot"
        COMMRT_COMM_SHM_SLOT_BYTES=$slot OMP_NUM_THREADS=1 timeout 60 "$PY" -m commrt.cli bench all_reduce --nproc 8 \
            -b 4M -e 32M -f 8 -n 5 -w 2 --backend zmq$([ $slot = 4194304 ] && echo ,gloo) --mode alone \
            | grep -v '^# alone' || echo "bench all_reduce failed ($?)"
    done
fi
if want train 100; then
    timeout $(( $(left) - 40 > 150 ? 150 : $(left) - 40 )) "$PY" -m commrt.cli bench train -n 8 \
        --stages dp,dp:4,0,0:4,2 --peers ddp-gloo "${model[@]}" --rounds 2 --json "$OUT/train8b.json" \
        || echo "bench train failed ($?)"
fi
if want slot 60; then
    COMMRT_COMM_SHM_SLOT_BYTES=16777216 timeout $(( $(left) - 5 )) "$PY" -m commrt.cli bench train -n 8 \
        --stages dp,0 --peers '' "${model[@]}" --rounds 2 --json "$OUT/train8slot.json" || echo "bench train failed ($?)"
fi
echo "took $(( $(date +%s) - t0 )) s"
