"""commrt leaves the user's process alone (issue 12.6): importing it installs no warnings filter,
and running collectives emits no warning (torch.frombuffer's 'The given buffer is not writable'
used to be silenced by a process-wide filter installed at import)."""
import subprocess
import sys
import threading
import warnings

import pytest
import torch

from commrt.collectives import ops
from commrt.collectives.context import Coll, OpContext
from commrt.collectives.reduce_ops import ReduceOp
from commrt.runtime.config import load_config
from commrt.transport import Endpoint, Transport


def test_import_leaves_warning_filters_unchanged():
    # torch and numpy add filters of their own at import: take the snapshot after them
    code = ("import warnings, numpy, torch, zmq, msgpack; before = list(warnings.filters); "
            "import commrt, commrt.collectives.ops, commrt.backends.zmq_backend; "
            "added = [f for f in warnings.filters if f not in before]; "
            "assert warnings.filters == before, added; print('unchanged')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "unchanged" in out.stdout, out.stderr[-2000:]


def _two_ranks(body):
    """Run ``body(ctx_factory, rank)`` as two ranks in threads over real loopback sockets."""
    cfg = load_config(None, {"comm": {"backend": "zmq"}, "security": {"mode": "none"}})
    transport = Transport(cfg, "rank0")
    eps = [Endpoint(transport, 0, r, ["rank0", "rank1"], "127.0.0.1", "", 64 << 20, 1.0, 20.0) for r in range(2)]
    errors = []
    try:
        for ep in eps:
            ep.connect({r: e.address for r, e in enumerate(eps)})

        def run(rank):
            seq = iter(range(1, 1000))
            make = lambda coll, dtype, count, **kw: OpContext(
                eps[rank], 0, rank, 2, next(seq), coll, dtype, count, 1 << 16, 1 << 12, **kw)
            try:
                body(make, rank)
            except BaseException as exc:  # re-raised in the test's thread
                errors.append(exc)
        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a rank hung"
    finally:
        for ep in eps:
            ep.close()
        transport.close()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_collectives_emit_no_warning(dtype):
    def body(make, rank):
        for numel in (10, 1 << 15):  # direct exchange and pipelined ring (small_bytes 4 KiB here)
            t = torch.full((numel,), rank + 1, dtype=dtype)
            ops.all_reduce(make(Coll.ALL_REDUCE, dtype, numel, reduce=ReduceOp.SUM), t, ReduceOp.SUM)
            assert torch.equal(t, torch.full((numel,), 3, dtype=dtype))
            out = torch.empty(numel, dtype=dtype)
            ops.reduce_scatter(make(Coll.REDUCE_SCATTER, dtype, 2 * numel, reduce=ReduceOp.MAX), out,
                               torch.full((2 * numel,), rank, dtype=dtype), ReduceOp.MAX)
            assert torch.equal(out, torch.ones(numel, dtype=dtype))
            ops.broadcast(make(Coll.BROADCAST, dtype, numel, root=1), t, 1)
            gathered = torch.empty(2 * numel, dtype=dtype)
            ops.all_gather(make(Coll.ALL_GATHER, dtype, 2 * numel), gathered, torch.full((numel,), rank, dtype=dtype))
            assert torch.equal(gathered[numel:], torch.ones(numel, dtype=dtype))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _two_ranks(body)
    assert not [str(w.message) for w in caught]
