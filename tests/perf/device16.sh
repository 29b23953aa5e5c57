#!/usr/bin/env bash
# The 16-core checks of issues 29 and 32 and the CUDA tests, as one prepared script for a lent
# GPU machine (16 cores; docs/PERFORMANCE.md, "On 16 cores"). One call of the device tool:
#
#   here, once:  echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: \
#                  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 -d .whl pyzmq==27.3.0
#   device run:  bash tests/perf/device16.sh 2>&1 | tee $OUT/device16.log     (carry [".whl"], timeout_s 590)
#
# Sections, in this order, each bounded by its own timeout and skipped when the whole script's
# budget (BUDGET_S, default 540 s) has not enough left for it; SECTIONS picks some:
#   small  commrt's shared-memory all_reduce (numpy buffers) against Open MPI's, 4 / 64 KiB, at
#          2, 4, 8 ranks, alternating; the per-layer breakdown at 8 (issue 32 item 3: <= 1.5x at 8)
#   train  commrt bench train at 4 and 8 ranks, every strategy with torch DDP / FSDP2 over gloo
#          (issue 29 item 3: >= the torch peer and >= 0.92; grouped strategies >= 0.90)
#   pipe   2-stage pipelines: the 5+ ms micro-batch model (1F1B >= 1.8x) and the default --bench
#   cuda   the `cuda`-marked tests (staging, quantized collectives on the device, fused codec)
# Figures go to stdout (and $OUT/*.json where a command writes JSON). OLD=DIR also runs the small
# section's commrt side from another tree (PYTHONPATH=DIR), alternating, for a before/after.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
root=$PWD
OUT=${OUT:-/tmp/device16}; mkdir -p "$OUT"
. tests/perf/device_env.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
SECTIONS=${SECTIONS:-small train pipe cuda}
t0=$(date +%s); budget=${BUDGET_S:-540}
left() { echo $(( budget - ($(date +%s) - t0) )); }
want() {  # section, seconds it needs
    case " $SECTIONS " in *" $1 "*) ;; *) return 1 ;; esac
    if [ "$(left)" -lt "$2" ]; then echo "== $1: skipped, $(left) s left of $budget"; return 1; fi
    echo "== $1 ($(date -u +%T), $(left) s left)"
}

date -u; nproc; grep -m1 'model name' /proc/cpuinfo
"$PY" -c 'import sys, zmq, torch, numpy; print(sys.version.split()[0], "zmq", zmq.__version__, "torch", torch.__version__, "numpy", numpy.__version__, "cuda", torch.cuda.is_available())'
git log --oneline -1 2>/dev/null

if want small 100; then
    export SIZES=4096,65536 INPUT=numpy ITERS=1000 SAMPLES=100
    ours() {  # ranks, tree
        PYTHONPATH=$2${PYTHONPATH#"$root"} timeout 60 "$PY" -m commrt.cli launch -n "$1" -- "$PY" -m tests.perf.small_ops
    }
    theirs() { command -v mpirun >/dev/null && timeout 60 mpirun --allow-run-as-root --oversubscribe -n "$1" "$PY" -m tests.perf.mpi_small_ops; }
    for n in 2 4 8 8; do
        echo "-- $n ranks: commrt"; ours "$n" "$root"
        [ -n "${OLD:-}" ] && { echo "-- $n ranks: commrt at $OLD"; ours "$n" "$OLD"; }
        echo "-- $n ranks: Open MPI"; theirs "$n" || echo "mpirun failed ($?)"
    done
    echo "-- 8 ranks: layers"; LAYERS=1 SAMPLES=20 ours 8 "$root"
    unset SIZES INPUT ITERS SAMPLES
fi

if want train 120; then
    for n in 4 8; do
        [ "$(left)" -lt 100 ] && { echo "-- train -n $n skipped: $(left) s left"; continue; }
        echo "-- bench train -n $n"
        timeout $(( $(left) - 60 > 200 ? 200 : $(left) - 60 )) "$PY" -m commrt.cli bench train -n "$n" \
            --stages dp,0,1,2,3,hpz,hybrid,mics,zeropp --peers ddp-gloo,fsdp-gloo --dim 384 --layers 4 \
            --steps 6 --warmup 2 --rounds 2 --json "$OUT/train$n.json" || echo "bench train -n $n failed ($?)"
    done
fi

if want pipe 60; then
    echo "-- pipeline, 5+ ms micro-batches"
    timeout 90 "$PY" -m workers.pipeline_lm --stages 2 --microbatches 16 --bench \
        --steps 2 --rounds 2 --dim 512 --blocks 8 --rows 512 --lr 0.01 || echo "pipeline bench failed ($?)"
    echo "-- pipeline, the default --bench model"
    timeout 40 "$PY" -m workers.pipeline_lm --stages 2 --bench --steps 10 \
        --rounds 2 || echo "default pipeline bench failed ($?)"
    echo "-- p2p pingpong"
    timeout 40 "$PY" -m commrt.cli bench p2p --backend zmq,gloo -b 4K -e 64K -f 4 -n 300 || echo "bench p2p failed ($?)"
fi

if want cuda 60; then
    timeout $(( $(left) - 10 )) "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -m cuda --maxfail 10 --timeout 120 \
        tests/multirank/test_cuda.py tests/multirank/test_quant_device.py tests/unit/test_quant_torch_codec.py \
        tests/unit/test_quant_fused.py 2>&1 | tail -n 30
    echo "cuda tests: exit ${PIPESTATUS[0]}"
fi
date -u; echo "took $(( $(date +%s) - t0 )) s"
