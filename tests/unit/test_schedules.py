"""The latency-optimal schedules (issue 32.1), run by a symbolic executor: every rank's buffer is
a list of chunk values, either expression trees (leaf = a rank, node = (left, right)) or numpy
arrays, and messages are matched first-in first-out per (sender, receiver) as on the wire."""
import math
from collections import defaultdict, deque

import numpy as np
import pytest

from commrt.collectives import schedules as sch
from commrt.collectives.algorithms import chunk_bounds

WORLDS = list(range(1, 34))


def _take(buf, rng, parts):
    lo, hi = rng
    return [buf[i % parts] for i in range(lo, hi)]


def execute(schedule, bufs, combine, out=None):
    """Run ``schedule`` over ``bufs`` (per rank, per chunk); ``out`` (all_to_all) receives into
    another buffer. Returns the number of messages each rank sent; fails on deadlock or a
    message whose size the receiver did not expect."""
    parts, ranks = schedule
    out = bufs if out is None else out
    queues, pos, sent_here = defaultdict(deque), [0] * len(ranks), [False] * len(ranks)
    progress = True
    while progress:
        progress = False
        for r, steps in enumerate(ranks):
            while pos[r] < len(steps):
                s = steps[pos[r]]
                if s.send_to is not None and not sent_here[r]:
                    queues[r, s.send_to].append((r, _take(bufs[r], s.send, parts)))
                    sent_here[r] = progress = True
                if s.recv_from is not None:
                    if not queues[s.recv_from, r]:
                        break
                    _, vals = queues[s.recv_from, r].popleft()
                    assert len(vals) == s.recv[1] - s.recv[0], (r, s)
                    for i, v in zip(range(*s.recv), vals):
                        i %= parts
                        if s.action == sch.REDUCE:
                            out[r][i] = combine(v, out[r][i]) if s.received_left else combine(out[r][i], v)
                        elif s.action == sch.COPY:
                            out[r][i] = v
                pos[r] += 1
                sent_here[r] = False
                progress = True
    assert all(p == len(st) for p, st in zip(pos, ranks)), f"deadlock at steps {pos}"
    assert not any(queues.values()), "messages nobody received"
    return [sch.messages_sent(st) for st in ranks]


def leaves(tree):
    return [tree] if isinstance(tree, int) else leaves(tree[0]) + leaves(tree[1])


def symbolic_all_reduce(algo, n):
    s = sch.schedule("all_reduce", algo, n)
    bufs = [[r] * s.parts for r in range(n)]
    return execute(s, bufs, lambda a, b: (a, b)), bufs


def _log2(n):
    return math.ceil(math.log2(n)) if n > 1 else 0


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("algo", ["recursive_doubling", "rabenseifner", "ring"])
def test_all_reduce_same_tree_on_every_rank(algo, n):
    sent, bufs = symbolic_all_reduce(algo, n)
    for c in range(len(bufs[0])):
        assert sorted(leaves(bufs[0][c])) == list(range(n))          # every rank, exactly once
        assert all(b[c] == bufs[0][c] for b in bufs)                  # same order: same bits
    pof2 = sch.pof2_below(n)
    extra = 1 if n != pof2 else 0  # the fold: the odd rank hands the result back
    if algo == "recursive_doubling":
        assert max(sent) == int(math.log2(pof2)) + extra and max(sent) <= _log2(n)
        assert max(len(st) for st in sch.schedule("all_reduce", algo, n).ranks) == int(math.log2(pof2)) + 2 * extra
    if algo == "rabenseifner":
        assert max(sent) == 2 * int(math.log2(pof2)) + extra


@pytest.mark.parametrize("n", [3, 5, 6, 7, 12, 13, 24, 33])
def test_doubling_and_rabenseifner_build_the_same_tree(n):
    _, rd = symbolic_all_reduce("recursive_doubling", n)
    _, rab = symbolic_all_reduce("rabenseifner", n)
    assert all(chunk == rd[0][0] for chunk in rab[0])


def numeric_all_reduce(algo, n, numel, values):
    s = sch.schedule("all_reduce", algo, n)
    bounds = chunk_bounds(numel, s.parts)
    bufs = [[values[r][a:b].copy() for a, b in bounds] for r in range(n)]
    execute(s, bufs, lambda a, b: a + b)
    return [np.concatenate(b) if b else np.zeros(0, values.dtype) for b in bufs]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 11, 16, 33])
@pytest.mark.parametrize("numel", [0, 1, 5, 100])
def test_integers_equal_the_ring_and_floats_agree_across_ranks(n, numel):
    rng = np.random.default_rng(n * 1000 + numel)
    ints = rng.integers(-2**40, 2**40, size=(n, numel))
    ring = numeric_all_reduce("ring", n, numel, ints)
    for algo in ("recursive_doubling", "rabenseifner"):
        got = numeric_all_reduce(algo, n, numel, ints)
        assert all(np.array_equal(g, ints.sum(0)) and np.array_equal(g, ring[0]) for g in got)
    floats = rng.standard_normal((n, numel)).astype(np.float32) * 1e4
    rd = numeric_all_reduce("recursive_doubling", n, numel, floats)
    rab = numeric_all_reduce("rabenseifner", n, numel, floats)
    assert all(g.tobytes() == rd[0].tobytes() for g in rd + rab)


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("root", [0, 1, 7])
def test_binomial_broadcast_and_reduce(n, root):
    root %= n
    s = sch.schedule("broadcast", "binomial", n, root)
    bufs = [["root" if r == root else None] for r in range(n)]
    sent = execute(s, bufs, None)
    assert all(b == ["root"] for b in bufs) and max(sent) == _log2(n) and sent[root] == _log2(n)
    s = sch.schedule("reduce", "binomial", n, root)
    bufs = [[r] for r in range(n)]
    sent = execute(s, bufs, lambda a, b: (a, b))
    assert sorted(leaves(bufs[root][0])) == list(range(n)) and max(sent) <= 1
    assert max(len(st) for st in s.ranks) <= _log2(n)


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("algo", ["bruck", "ring"])
def test_all_gather(algo, n):
    s = sch.schedule("all_gather", algo, n)
    bufs = [[r if c == r else None for c in range(n)] for r in range(n)]
    sent = execute(s, bufs, None)
    assert all(b == list(range(n)) for b in bufs)
    assert max(sent) == (_log2(n) if algo == "bruck" else n - 1)
    # bandwidth-optimal as well: each rank receives every other chunk exactly once
    assert all(sum(st.recv[1] - st.recv[0] for st in steps) == n - 1 for steps in s.ranks)


@pytest.mark.parametrize("n", WORLDS)
def test_pairwise_all_to_all(n):
    s = sch.schedule("all_to_all", "pairwise", n)
    inp = [[(r, c) for c in range(n)] for r in range(n)]
    out = [[(r, r) if c == r else None for c in range(n)] for r in range(n)]  # own chunk: a local copy
    execute(s, inp, None, out)
    assert all(out[r] == [(c, r) for c in range(n)] for r in range(n))


@pytest.mark.parametrize("n", WORLDS)
def test_dissemination_barrier_everyone_hears_everyone(n):
    heard = [[{r}] for r in range(n)]
    s = sch.schedule("barrier", "dissemination", n)
    # a barrier carries no data: model what each rank has (transitively) heard of as the message
    ranks = [[st._replace(send=(0, 1), recv=(0, 1), action=sch.REDUCE) for st in steps] for steps in s.ranks]
    sent = execute(sch.Schedule(1, ranks), heard, lambda a, b: a | b)
    assert all(h[0] == set(range(n)) for h in heard) and max(sent) == _log2(n)


@pytest.mark.parametrize("n,pieces", [(1, 3), (2, 1), (5, 4), (9, 2)])
def test_chain_broadcast_pipelines(n, pieces):
    s = sch.schedule("broadcast", "chain", n, root=n // 2, pieces=pieces)
    bufs = [[i if r == n // 2 else None for i in range(pieces)] for r in range(n)]
    execute(s, bufs, None)
    assert all(b == list(range(pieces)) for b in bufs)


@pytest.mark.parametrize("n,root", [(1, 0), (4, 2), (7, 3)])
def test_ring_reduce(n, root):
    s = sch.schedule("reduce", "ring", n, root)
    bufs = [[r] * n for r in range(n)]
    execute(s, bufs, lambda a, b: (a, b))
    assert all(sorted(leaves(c)) == list(range(n)) for c in bufs[root])
