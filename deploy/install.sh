#!/usr/bin/env bash
# Make .venv with commrt and its test tools; safe to run again.
# torch: reuse one the base interpreter already has (typical on GPU machines, keeping its CUDA
# build); else try torch==2.13.0 (a local CPU wheel on the CPU dev/CI machines), else the newest
# torch from the index. COMMRT_TORCH overrides the requirement, e.g. COMMRT_TORCH="torch==2.5.1".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ -n "${COMMRT_TORCH:-}" ]; then
    .venv/bin/python -m pip install -q "$COMMRT_TORCH"
  else
    .venv/bin/python -m pip install -q "torch==2.13.0" || .venv/bin/python -m pip install -q torch
  fi
fi
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c "import commrt, torch, zmq; print('commrt', commrt.__version__, '| torch', torch.__version__, '| libzmq', zmq.zmq_version())"
