#!/usr/bin/env bash
# One command that checks a GPU machine (issue 34): the `cuda` tests, the fused codec's
# throughput next to a device copy, and one report (report.md + report.json) in $1
# (default ./gpu-report). Needs a Python with a CUDA torch (and Triton, for the fused codec);
# installs nothing outside the project: pyzmq / msgpack (and pytest, if that Python lacks it)
# come from a local wheel folder named by COMMRT_WHEELS, into a folder of their own.
#   PYTHON            the interpreter (default python3)
#   COMMRT_WHEELS     a folder of wheels to install from (no index is asked)
#   FUSED_TIMEOUT     seconds for the fused codec's tests (default 600)
#   BENCH_TIMEOUT     seconds for the codec benchmark (default 600)
#   CUDA_TIMEOUT      seconds for the rest of `pytest -m cuda` (default 1800)
#   STAGING_TIMEOUT   seconds for the 2-rank CUDA-vs-CPU all_reduce timing over zmq (default 300)
#   CLI_TIMEOUT       seconds for `commrt bench --device cuda` (default 300)
#   CUDA_TESTS        what the last pytest run takes (default: all of tests/)
set -uo pipefail

out=${1:-./gpu-report}
mkdir -p "$out"
out=$(cd "$out" && pwd)
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" || exit 1
py=${PYTHON:-python3}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

if [ -n "${COMMRT_WHEELS:-}" ]; then
    site=$(mktemp -d "${TMPDIR:-/tmp}/commrt-gpu-site.XXXXXX")
    want=(pyzmq msgpack)
    "$py" -c 'import pytest' 2>/dev/null || want+=(pytest pytest-timeout)
    "$py" -m pip install --quiet --no-index --find-links "$COMMRT_WHEELS" --target "$site" "${want[@]}" \
        > "$out/install.log" 2>&1 || echo "wheel install failed: see install.log" >&2
    export PYTHONPATH="$site:$PYTHONPATH"
fi

"$py" -V
"$py" -m commrt.bench.gpu_check env

pytest_run() {  # name, timeout, pytest arguments...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$py" -m pytest -q -p no:cacheprovider -o addopts="" --junitxml "$out/junit-$name.xml" "$@" \
        > "$out/pytest-$name.log" 2>&1
    echo "pytest $name: exit $? ($(tail -n 1 "$out/pytest-$name.log"))"
}

timeout "${BENCH_TIMEOUT:-600}" "$py" -m commrt.bench.gpu_check codec "$out/codec.json" \
    || echo "codec benchmark failed (exit $?)" >&2
timeout "${STAGING_TIMEOUT:-300}" "$py" -m commrt.cli launch -n 2 -- "$py" -m tests.gpu.staging_timing \
    "$out/staging.json" > "$out/staging.log" 2>&1 || echo "staging timing failed (exit $?): see staging.log" >&2
timeout "${CLI_TIMEOUT:-300}" "$py" -m commrt.cli bench all_reduce --device cuda --backend zmq,gloo --quant int8,int4 \
    -b 1M -e 16M -f 4 -n 5 -w 2 --mode back-to-back --json "$out/bench-cuda.json" > "$out/bench-cuda.log" 2>&1 \
    || echo "commrt bench --device cuda failed (exit $?): see bench-cuda.log" >&2
pytest_run fused_fast "${FUSED_TIMEOUT:-600}" -m cuda --maxfail 20 -k fast tests/unit/test_quant_fused.py
pytest_run fused "${FUSED_TIMEOUT:-600}" -m cuda --maxfail 20 -k "not fast" tests/unit/test_quant_fused.py
pytest_run cuda "${CUDA_TIMEOUT:-1800}" -m cuda --deselect tests/unit/test_quant_fused.py ${CUDA_TESTS:-tests}
"$py" -m commrt.bench.gpu_check report "$out"
echo "report: $out/report.md"
