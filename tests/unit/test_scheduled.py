"""The schedule executor (collectives/scheduled.py) and ops.py's use of it, on threads: each rank
runs the real ops.py function over an in-memory context whose messages are copied into FIFO
queues per (sender, receiver), as ZeroMQ delivers them. Every algorithm is pinned in turn
through selection.table_from and compared with a single-process reference; the multirank
matrix (tests/multirank/test_matrix.py, program matrix_algos) does the same over real sockets."""
import queue
import threading

import numpy as np
import pytest
import torch

from commrt.collectives import ops
from commrt.runtime.arrays import as_bytes, empty_of, frombuffer, numel as numel_of
from commrt.collectives.reduce_ops import ReduceOp
from commrt.collectives.scheduled import spans, step_pieces
from commrt.collectives.schedules import messages_sent, schedule
from commrt.collectives.selection import choose, table_from


class FakeCtx:
    def __init__(self, rank, n, dtype, table, wires, piece_elems=5):
        self.rank, self.size, self.dtype, self.table = rank, n, dtype, table
        # small_bytes huge: a path that still tested it (a direct exchange) would show in the counts
        self.itemsize, self.piece_elems, self.small_bytes = dtype.itemsize, piece_elems, 1 << 30
        self.wires, self.sent, self.bytes_to = wires, 0, {}

    def algorithm(self, collective, nbytes):
        return choose(collective, nbytes, self.size, self.table)

    def send(self, dst, data=None):
        payload = b"" if data is None or not numel_of(data) else as_bytes(data).tobytes()  # array or tensor
        self.wires[self.rank, dst].put(payload)
        self.sent += 1
        self.bytes_to[dst] = self.bytes_to.get(dst, 0) + len(payload)

    def recv_buffer(self, src, numel):
        payload = self.wires[src, self.rank].get(timeout=10)
        assert len(payload) == numel * self.itemsize, (src, self.rank, len(payload), numel)
        return bytearray(payload)

    def recv(self, src, numel=0):
        buf = self.recv_buffer(src, numel)
        return frombuffer(buf, self.dtype) if numel else empty_of(0, self.dtype)  # as OpContext.recv

    def flush(self):
        pass


def run_ranks(n, dtype, table, body, piece_elems=5):
    """``body(ctx)`` on n threads; returns each rank's (result, messages sent)."""
    wires = {(a, b): queue.Queue() for a in range(n) for b in range(n)}
    results, errors = [None] * n, []

    def one(r):
        ctx = FakeCtx(r, n, dtype, table, wires, piece_elems)
        try:
            results[r] = (body(ctx), ctx.sent)
        except BaseException as exc:  # noqa: BLE001 (reported below, with the rank)
            errors.append((r, exc))
    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert all(w.empty() for w in wires.values()), "messages nobody received"
    return results


def values(numel, rank, dtype, seed):
    rng = np.random.default_rng(seed * 100 + rank)
    return torch.from_numpy(rng.integers(-8, 9, size=numel)).to(dtype)


REDUCE = {ReduceOp.SUM: lambda a, b: a + b, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum,
          ReduceOp.PRODUCT: lambda a, b: a * b}


def reference(parts, op):
    wide = [p.long().numpy() for p in parts]
    acc = wide[0]
    for w in wide[1:]:
        acc = REDUCE[op](acc, w)
    return torch.from_numpy(np.ascontiguousarray(acc)).to(parts[0].dtype)


WORLDS = [1, 2, 3, 4, 5, 6, 7, 8]
SIZES = [1, 3, 7, 40]  # fewer elements than chunks, odd, many pieces of 5


def test_spans_wrap_and_skip_empty_chunks():
    bounds = [(0, 2), (2, 2), (2, 5), (5, 6)]
    assert spans((0, 4), bounds) == [(0, 6)]
    assert spans((3, 5), bounds) == [(5, 6), (0, 2)]  # Bruck's wrap: two spans
    assert spans((1, 2), bounds) == [] and step_pieces((1, 2), bounds, 4) == [(0, 0)]
    assert step_pieces((2, 4), bounds, 2) == [(2, 4), (4, 6)]  # chunks 2 and 3 merge


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "rabenseifner", "ring"])
@pytest.mark.parametrize("n", WORLDS)
def test_all_reduce_every_algorithm_equals_the_reference(algorithm, n):
    table = table_from({"all_reduce": algorithm})
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.PRODUCT):
        for numel in SIZES:
            parts = [values(numel, r, torch.int64, numel + op) for r in range(n)]

            def body(ctx):
                t = parts[ctx.rank].clone()
                ops.all_reduce(ctx, t, op)
                return t
            for got, _ in run_ranks(n, torch.int64, table, body):
                assert torch.equal(got, reference(parts, op)), (algorithm, n, op, numel)


@pytest.mark.parametrize("n", [3, 5, 6, 8])
def test_float_results_are_bit_identical_on_every_rank_and_across_doubling_and_rabenseifner(n):
    parts = [torch.from_numpy(np.random.default_rng(r).standard_normal(37).astype(np.float32)) for r in range(n)]
    seen = []
    for algorithm in ("recursive_doubling", "rabenseifner"):
        def body(ctx):
            t = parts[ctx.rank].clone()
            ops.all_reduce(ctx, t, ReduceOp.SUM)
            return t.view(torch.int32)
        seen += [got for got, _ in run_ranks(n, torch.float32, table_from({"all_reduce": algorithm}), body)]
    assert all(torch.equal(s, seen[0]) for s in seen)
    # the comparison sees summation order: the ring (another order) differs in the last bits
    ring = run_ranks(n, torch.float32, table_from({"all_reduce": "ring"}), body)
    assert all(torch.equal(got, ring[0][0]) for got, _ in ring) and not torch.equal(ring[0][0], seen[0])


@pytest.mark.parametrize("algorithm", ["binomial", "ring"])
@pytest.mark.parametrize("n", WORLDS)
def test_reduce_and_broadcast_every_root(algorithm, n):
    table = table_from({"reduce": algorithm, "broadcast": "binomial" if algorithm == "binomial" else "chain"})
    for root in range(n):
        parts = [values(11, r, torch.int32, root) for r in range(n)]

        def body(ctx):
            t, b = parts[ctx.rank].clone(), parts[ctx.rank].clone()
            ops.reduce(ctx, t, root, ReduceOp.SUM)
            before = ctx.sent
            ops.broadcast(ctx, b, root)
            return t, b, ctx.sent - before
        bcast = "binomial" if algorithm == "binomial" else "chain"
        pieces = -(-11 // 5)  # the chain pipelines 11 elements in pieces of 5
        want = schedule("broadcast", bcast, n, root, pieces if bcast == "chain" else 1).ranks
        for r, ((t, b, sent), _) in enumerate(run_ranks(n, torch.int32, table, body)):
            assert torch.equal(t, reference(parts, ReduceOp.SUM) if r == root else parts[r]), (n, root, r)
            assert torch.equal(b, parts[root]), (n, root, r)
            per_step = pieces if bcast == "binomial" else 1  # binomial: each send cut into the pieces
            # the schedule ran, and the one empty message that checks the root (ops._agree_on_root)
            assert sent == messages_sent(want[r]) * per_step + (n > 1), (n, root, r, sent)


@pytest.mark.parametrize("algorithm", ["bruck", "ring"])
@pytest.mark.parametrize("n", WORLDS)
def test_all_gather(algorithm, n):
    for m in (1, 3, 12):
        parts = [values(m, r, torch.int16, m) for r in range(n)]

        def body(ctx):
            out = torch.full((n * m,), 99, dtype=torch.int16)
            ops.all_gather(ctx, out, parts[ctx.rank])
            return out
        for got, _ in run_ranks(n, torch.int16, table_from({"all_gather": algorithm}), body):
            assert torch.equal(got, torch.cat(parts)), (algorithm, n, m)


@pytest.mark.parametrize("n", WORLDS)
def test_all_to_all_uneven_and_barrier(n):
    rows = lambda r, j: (r + j) % 3  # noqa: E731
    blocks = {(r, j): values(rows(r, j), r * n + j, torch.int64, 7) for r in range(n) for j in range(n)}

    def body(ctx):
        inp = torch.cat([blocks[ctx.rank, j] for j in range(n)])
        out = torch.full((sum(rows(j, ctx.rank) for j in range(n)),), 77, dtype=torch.int64)
        bounds = lambda sizes: [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(n)]  # noqa: E731
        ops.all_to_all(ctx, out, inp, bounds([rows(j, ctx.rank) for j in range(n)]),
                       bounds([rows(ctx.rank, j) for j in range(n)]))
        before = ctx.sent
        ops.barrier(ctx)
        return out, ctx.sent - before
    for r, ((out, barrier_msgs), _) in enumerate(run_ranks(n, torch.int64, table_from(None), body)):
        assert torch.equal(out, torch.cat([blocks[j, r] for j in range(n)]))
        assert barrier_msgs == (n - 1).bit_length()


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_small_all_reduce_sends_log2_n_messages_per_rank(n):
    """The default table's small all_reduce (recursive doubling): log2 n messages, where the old
    direct exchange sent n - 1 (and the ring 2 (n - 1))."""
    def body(ctx):
        t = torch.ones(4, dtype=torch.int32)
        ops.all_reduce(ctx, t, ReduceOp.SUM)
        return int(t[0])
    for got, sent in run_ranks(n, torch.int32, table_from(None), body, piece_elems=1 << 20):
        assert (got, sent) == (n, n.bit_length() - 1)


def test_comm_stats_counts_messages_per_op():
    from commrt.obs.stats import split_by_node
    from commrt.transport.wire import COLL
    sent = {(COLL, 1, "rank1"): 40, (COLL, 1, "rank2"): 0}
    msgs = {(COLL, 1, "rank1"): 3, (COLL, 1, "rank2"): 2}
    out = split_by_node(sent, [True, True, False], msgs)
    assert out["by_op"]["all_reduce"] == {"intra_node_bytes": 40, "inter_node_bytes": 0, "messages": 5}
    assert "messages" not in split_by_node(sent, [True, True, False])["by_op"]["all_reduce"]


EMPTY_PINS = [("all_reduce", a) for a in ("recursive_doubling", "rabenseifner", "ring")] + \
    [("broadcast", "binomial"), ("broadcast", "chain"), ("reduce", "binomial"), ("reduce", "ring"),
     ("all_gather", "bruck"), ("all_gather", "ring")]


@pytest.mark.parametrize("collective,algorithm", EMPTY_PINS)
@pytest.mark.parametrize("n", [2, 3, 5])
def test_an_empty_op_sends_its_schedules_messages(collective, algorithm, n):
    """No elements still runs the schedule, of empty messages: a rank that skipped the op left
    peers holding elements waiting for it until the deadline (ops.py). reduce_scatter (not in the
    table) sends its direct exchange's n - 1."""
    root = n - 1
    run = {"all_reduce": lambda c, t: ops.all_reduce(c, t, ReduceOp.SUM),
           "broadcast": lambda c, t: ops.broadcast(c, t, root),
           "reduce": lambda c, t: ops.reduce(c, t, root, ReduceOp.SUM),
           "all_gather": lambda c, t: ops.all_gather(c, t, t)}[collective]
    want = schedule(collective, algorithm, n, root).ranks
    rooted = collective in ("broadcast", "reduce")  # + the message that checks the root
    for r, (_, sent) in enumerate(run_ranks(n, torch.float32, table_from({collective: algorithm}),
                                            lambda ctx: run(ctx, torch.empty(0)))):
        assert sent == messages_sent(want[r]) + rooted, (r, sent)
    for _, sent in run_ranks(n, torch.float32, table_from(None),
                             lambda ctx: ops.reduce_scatter(ctx, torch.empty(0), torch.empty(0), ReduceOp.SUM)):
        assert sent == n - 1
