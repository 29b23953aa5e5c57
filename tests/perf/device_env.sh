# Sourced by the device scripts (device16.sh, device_train8.sh) from the repository root: python
# (PY), pyzmq from the carried .whl folder where the machine lacks it, and PYTHONPATH with this tree.
PY=${PY:-python3}
if ! "$PY" -c 'import zmq' 2>/dev/null; then
    [ -d .whl ] || { echo "no pyzmq and no .whl folder of wheels" >&2; exit 1; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
