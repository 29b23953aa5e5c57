"""A rank that moves only numpy buffers (issue 32.2): the transport, collectives and runtime run
on numpy arrays, in place, without importing torch, and give what the same ops give on tensors.
The algorithms run on threads over test_scheduled's in-memory context (real ops.py code, numpy
buffers end to end); the import check runs a real one-rank world in a fresh interpreter."""
import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from commrt.collectives import ops
from commrt.collectives.aliasing import Aliased
from commrt.collectives.reduce_ops import ReduceOp, combine_into, finish_avg_, reduce_in_order_
from commrt.collectives.selection import table_from
from commrt.launch import free_port
from commrt.runtime.dtypes import byte_span, overlaps
from tests.unit.test_scheduled import WORLDS, reference, run_ranks, values

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# every public call a numpy user makes, on a real one-rank world (init rendezvous, its barrier,
# the backend, comm_stats, teardown), then the check that torch never loaded
PROGRAM = """
import sys
import numpy as np
import commrt
commrt.init_process_group()
x = np.arange(1024, dtype=np.float32)
commrt.all_reduce(x)
commrt.broadcast(x, 0)
commrt.barrier()
out = np.zeros(1024, np.float32)
commrt.all_gather_into_tensor(out, x)
commrt.reduce_scatter_tensor(np.zeros(1024, np.float32), out)
commrt.all_to_all_single(np.zeros(1024, np.float32), x)
commrt.all_reduce(np.ones((4, 4), np.int64)[:, ::2])  # non-contiguous: written back
res = commrt.comm_stats()["resources"]
assert res["rss_kib"] > 0 and res["open_files"] > 0 and res["threads"] > 0, res
commrt.destroy_process_group()
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("TORCH", loaded[:3], "RSS_KIB", res["rss_kib"], flush=True)
"""


def test_a_numpy_rank_never_imports_torch():
    env = {**os.environ, "PYTHONPATH": ROOT, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "COMMRT_COMM_BACKEND": "auto", "COMMRT_COMM_TIMEOUT_S": "30"}
    done = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TORCH [] " in done.stdout, done.stdout + done.stderr[-3000:]


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "rabenseifner", "ring"])
@pytest.mark.parametrize("n", WORLDS)
def test_all_reduce_on_numpy_equals_the_reference_and_the_tensor_run(algorithm, n):
    table = table_from({"all_reduce": algorithm})
    ints = [values(23, r, torch.int64, 5).numpy() for r in range(n)]
    floats = [np.random.default_rng(r).standard_normal(37).astype(np.float32) for r in range(n)]

    def body(parts, wrap):
        def run(ctx):
            buf = wrap(parts[ctx.rank].copy())
            ops.all_reduce(ctx, buf, ReduceOp.SUM)
            return buf
        return run
    want = reference([torch.from_numpy(p) for p in ints], ReduceOp.SUM).numpy()
    for got, _ in run_ranks(n, np.dtype(np.int64), table, body(ints, lambda a: a)):
        assert isinstance(got, np.ndarray) and np.array_equal(got, want), (algorithm, n)
    as_numpy = [got for got, _ in run_ranks(n, np.dtype(np.float32), table, body(floats, lambda a: a))]
    as_tensor = [got for got, _ in run_ranks(n, torch.float32, table, body(floats, torch.from_numpy))]
    assert all(np.array_equal(a.view(np.int32), t.numpy().view(np.int32)) for a, t in zip(as_numpy, as_tensor))


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_every_other_collective_on_numpy(n):
    """all_gather (Bruck), reduce and broadcast (binomial), all_to_all, barrier; the in-place
    reduce_scatter form through the aliasing rules, with numpy views."""
    parts = [values(6, r, torch.int32, 9).numpy() for r in range(n)]
    whole = np.concatenate(parts)
    total = reference([torch.from_numpy(p) for p in parts], ReduceOp.SUM).numpy()

    def body(ctx):
        gathered = np.full(6 * n, 99, np.int32)
        ops.all_gather(ctx, gathered, parts[ctx.rank])
        reduced, copied = parts[ctx.rank].copy(), parts[ctx.rank].copy()
        ops.reduce(ctx, reduced, 0, ReduceOp.SUM)
        ops.broadcast(ctx, copied, n - 1)
        swapped = np.zeros(n, np.int32)
        ops.all_to_all(ctx, swapped, np.arange(n, dtype=np.int32) + 10 * ctx.rank,
                       [(j, j + 1) for j in range(n)], [(j, j + 1) for j in range(n)])
        ops.barrier(ctx)
        big = np.tile(parts[ctx.rank], n)  # n blocks of 6: the reduce_scatter in its in-place form
        Aliased(ops).reduce_scatter(ctx, big[6 * ctx.rank:6 * ctx.rank + 6], big, ReduceOp.SUM)
        return gathered, reduced, copied, swapped, big[6 * ctx.rank:6 * ctx.rank + 6]
    for r, ((gathered, reduced, copied, swapped, scattered), _) in enumerate(
            run_ranks(n, np.dtype(np.int32), table_from(None), body)):
        assert np.array_equal(gathered, whole)
        assert np.array_equal(reduced, total if r == 0 else parts[r])
        assert np.array_equal(copied, parts[n - 1])
        assert np.array_equal(swapped, np.arange(n, dtype=np.int32) * 10 + r)
        assert np.array_equal(scattered, total)


def test_kernels_on_numpy_match_torch():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal(100).astype(np.float32), rng.standard_normal(100).astype(np.float32)
    for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX):
        out_np, out_t = np.empty_like(a), torch.empty(100)
        combine_into(out_np, a, b, op)
        combine_into(out_t, torch.from_numpy(a), torch.from_numpy(b), op)
        assert np.array_equal(out_np, out_t.numpy()), op
    out = np.empty(100, np.float32)
    reduce_in_order_(out, [a, b.tobytes(), memoryview(a.tobytes())], ReduceOp.SUM)  # frames as bytes
    assert np.array_equal(out, (a + b) + a)
    ints = np.array([7, -7, 9], np.int64)
    finish_avg_(ints, 2)
    assert ints.tolist() == [3, -4, 4]  # integer AVG floors, as on tensors


def test_overlap_of_numpy_views_by_address():
    base = np.arange(20, dtype=np.float32)
    assert overlaps(base[2:5], base[4:9]) and not overlaps(base[2:5], base[5:9])
    rev = base[::-1]  # numpy strides may be negative: the span still covers the whole buffer
    assert byte_span(rev) == byte_span(base)
    assert overlaps(rev[:3], base[17:]) and not overlaps(rev[:3], base[:17])
    assert overlaps(np.frombuffer(base, np.uint8)[8:12], base[2:3])  # another array, same bytes


@contextlib.contextmanager
def _endpoints(n: int):
    """Real, connected Endpoints of ranks 0..n-1 of one group in this process (one Transport
    each, as n processes would have); closed afterwards."""
    from commrt.runtime.config import load_config
    from commrt.transport import Endpoint, Transport

    cfg = load_config(None, {"comm": {"backend": "zmq"}, "security": {"mode": "none"}})
    names = [f"rank{r}" for r in range(n)]
    sides = [Transport(cfg, name) for name in names]
    eps = [Endpoint(sides[r], 0, r, names, "127.0.0.1", "", 1 << 20, 3.0, 10.0) for r in range(n)]
    try:
        table = {r: ep.address for r, ep in enumerate(eps)}
        for ep in eps:
            ep.connect(table)
        yield eps
    finally:
        for ep in eps:
            ep.close()
        for side in sides:
            side.close()


def test_a_lost_rank_heard_from_a_peer_is_passed_on_over_existing_connections_only():
    """Issue 32.5: a rank that sees a peer die tells every peer; a rank told passes the notice on
    only to the peers it has a connection to (at 256 ranks, every told rank dialling all others
    made 65,000 connections after one death and the last survivor heard of it after 16 s).
    Real endpoints of 4 ranks in one process: rank 3 is the lost one."""
    from commrt.runtime.errors import PeerLost
    from commrt.transport.wire import COLL, Coll, Header

    with _endpoints(4) as eps:
        eps[0].send(1, Header(COLL, 0, 1, 0, int(Coll.BARRIER), 6, 0, 0, 0), b"", op="barrier")
        eps[1].recv(0, op="barrier", seq=1, timeout_s=10.0)  # rank 0 now has a connection to 1 only
        eps[0].tell_peers(2, lost=3, connected_only=True)  # heard, so passed on
        assert sorted(eps[0]._out) == [1], "a relayed notice dialled new peers"
        with pytest.raises(PeerLost) as lost:
            eps[1].recv(2, op="all_reduce", seq=2, timeout_s=10.0)
        assert (lost.value.rank, lost.value.reported_by) == (3, 0)
        eps[0].tell_peers(2, lost=3)  # seen first-hand: every peer but the lost one
        assert sorted(eps[0]._out) == [1, 2]
        with pytest.raises(PeerLost) as lost:
            eps[2].recv(1, op="all_reduce", seq=2, timeout_s=10.0)
        assert (lost.value.rank, lost.value.reported_by) == (3, 0)


def test_a_first_hand_notice_dials_without_monitors_and_no_more_once_another_arrived():
    """A rank that saw a peer die tells every peer before its own PeerLost reaches its caller.
    The sockets it dials only for that carry no liveness monitor (no wait reads them: the group
    is unusable after the notice), and it dials no more once another rank's notice of the same
    loss has arrived (that rank told everyone). At 256 ranks on 2 cores the 8 ranks that saw
    it each dialled 240 peers with monitors while the ranks told tore down, and named it last,
    10 s after them. Real endpoints of 5 ranks in one process: rank 4 is the lost one."""
    from commrt.runtime.errors import PeerLost
    from commrt.transport.wire import COLL, Coll, Header

    with _endpoints(5) as eps:
        eps[0].send(1, Header(COLL, 0, 1, 0, int(Coll.BARRIER), 6, 0, 0, 0), b"", op="barrier")
        eps[1].recv(0, op="barrier", seq=1, timeout_s=10.0)  # rank 0 waits on rank 1: watched
        eps[0].tell_peers(2, lost=4)  # seen first-hand: every peer but the lost one
        assert sorted(eps[0]._out) == [1, 2, 3]
        assert sorted(eps[0].live._monitors.values()) == [1], "a notice-only socket got a monitor"
        for r in (1, 2):
            with pytest.raises(PeerLost) as lost:
                eps[r].recv(0, op="all_reduce", seq=2, timeout_s=10.0)
            assert (lost.value.rank, lost.value.reported_by) == (4, 0)
        # rank 3 sees rank 4 go too, after rank 0's notice arrived: nobody left to dial for
        assert eps[3].inbound.poll(10_000), "rank 0's notice did not arrive"
        eps[3].tell_peers(2, lost=4)
        assert sorted(eps[3]._out) == [], "dialled every peer after another rank had told them"


def test_a_backend_passes_on_what_it_heard_only_over_its_connections():
    from types import SimpleNamespace

    from commrt.backends.zmq_backend import ZmqBackend
    from commrt.runtime.errors import PeerLost
    calls = []
    stub = SimpleNamespace(_coll=SimpleNamespace(tell_peers=lambda seq, **kw: calls.append(kw)), _broken=None,
                           _members=None, group_id=0)
    ctx = SimpleNamespace(seq=5)
    ZmqBackend._give_up(stub, PeerLost(3, "all_reduce", 5, "connection lost 1.0s ago"), ctx)
    ZmqBackend._give_up(stub, PeerLost(3, "all_reduce", 5, "rank 0 reported it lost", reported_by=0), ctx)
    assert calls == [{"lost": 3, "connected_only": False}, {"lost": 3, "connected_only": True}]


def test_a_subgroup_tells_its_peers_group_ranks_and_its_caller_global_ones():
    """Group [0, 2, 5]: the peers' ABORT carries the group rank (their transport's numbering);
    the PeerLost raised to the caller names the global rank and which group rank that is."""
    from types import SimpleNamespace

    from commrt.backends.zmq_backend import ZmqBackend
    from commrt.runtime.errors import PeerLost
    calls = []
    stub = SimpleNamespace(_coll=SimpleNamespace(tell_peers=lambda seq, **kw: calls.append(kw)), _broken=None,
                           _members=[0, 2, 5], group_id=7)
    exc = ZmqBackend._give_up(stub, PeerLost(1, "all_reduce", 5, "rank 2 reported it lost", reported_by=2),
                              SimpleNamespace(seq=5))
    assert calls == [{"lost": 1, "connected_only": True}]
    assert (exc.rank, exc.reported_by, exc.op, exc.seq) == (2, 5, "all_reduce", 5) and stub._broken is exc
    assert str(exc).startswith("lost peer rank 2 during all_reduce (seq 5): rank 2 reported it lost [rank 1 of group 7")
    same = PeerLost(1, "recv", 3, "timeout")
    assert same.in_group([0, 1, 4], 7) is same  # numbered as the world numbers them: unchanged
    anyone = PeerLost(-1, "recv", 3, "no message from any rank")
    assert anyone.in_group([0, 2], 7) is anyone


def test_a_subgroups_mismatch_names_global_ranks():
    """Group [0, 2, 5]: a mismatch between group ranks 1 and 2 (reported by group rank 1) is
    raised naming global ranks 2 and 5 (it named the group's 1 and 2, other processes)."""
    from types import SimpleNamespace

    from commrt.backends.zmq_backend import ZmqBackend
    from commrt.runtime.errors import CollectiveMismatch
    stub = SimpleNamespace(_coll=None, _broken=None, _members=[0, 2, 5], group_id=7)
    seen = CollectiveMismatch("all_reduce", 4, {"count": 8}, {"count": 9}, peer=2, rank=1, reported_by=1)
    exc = ZmqBackend._give_up(stub, seen, SimpleNamespace(seq=4))
    assert (exc.rank, exc.peer, exc.reported_by, exc.seq, stub._broken) == (2, 5, 2, 4, exc)
    assert str(exc).startswith("collective mismatch at seq 4: rank 2 runs {count=8}, rank 5 runs {count=9}")
    assert str(exc).endswith("(reported by rank 2) [ranks 1 and 2 of group 7]"), exc
    same = CollectiveMismatch("barrier", 1, {}, {"op": "broadcast"}, peer=1, rank=0)
    assert same.in_group([0, 1, 4], 7) is same  # numbered as the world numbers them: unchanged
