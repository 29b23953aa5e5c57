#!/usr/bin/env bash
# Make .venv with commrt and its test tools; safe to run again.
# torch: reuse one the base interpreter already has (typical on GPU machines, keeping its CUDA
# build); else try torch==2.13.0 (a local CPU wheel on the CPU dev/CI machines), else the newest
# torch from the index. COMMRT_TORCH overrides the requirement, e.g. COMMRT_TORCH="torch==2.5.1".
# Each step prints a line; torch's download (minutes) shows pip's own progress (issue 31.6).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
step() { printf '==> %s\n' "$*"; }
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    step "creating .venv on $PY, reusing its torch (--system-site-packages)"
    "$PY" -m venv --system-site-packages .venv
  else
    step "creating .venv on $PY"
    "$PY" -m venv .venv
  fi
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # no -q: pip's progress bar on a terminal, its Collecting/Downloading lines otherwise
  if [ -n "${COMMRT_TORCH:-}" ]; then
    step "installing $COMMRT_TORCH (COMMRT_TORCH)"
    .venv/bin/python -m pip install "$COMMRT_TORCH"
  else
    step "installing torch==2.13.0 (falls back to the newest torch)"
    .venv/bin/python -m pip install "torch==2.13.0" \
      || { step "torch==2.13.0 unavailable: installing the newest torch"; .venv/bin/python -m pip install torch; }
  fi
else
  step "torch already importable in .venv: $(.venv/bin/python -c 'import torch; print(torch.__version__)')"
fi
step "installing commrt (editable) with [test]"
.venv/bin/python -m pip install -q -e ".[test]"
step "compiling the sources to bytecode (every process, each rank of a job, starts from it)"
# an editable install compiles nothing, and where PYTHONDONTWRITEBYTECODE is set no process
# writes what it compiled: each rank then compiled ~100 modules on start (0.3 s of CPU a rank)
.venv/bin/python -m compileall -q -j 0 commrt servers workers tests > /dev/null \
  || step "some files did not compile (each is compiled again where it is imported)"
step "checking the install"
.venv/bin/python -c "import commrt, torch, zmq; print('commrt', commrt.__version__, '| torch', torch.__version__, '| libzmq', zmq.zmq_version())"
step "done: activate with  source .venv/bin/activate"
