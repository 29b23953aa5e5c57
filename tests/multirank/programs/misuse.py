"""API misuse that must end in a clear typed error (or, for grad-requiring tensors, just work),
checked on real ranks. ``python -m tests.multirank.programs.misuse <mode>``; every rank prints
'misuse <mode> ok' when its checks passed."""
from __future__ import annotations

import sys

import numpy as np

import commrt


def expect(exc_type, fragment: str, fn, *args, **kwargs):
    """Run ``fn``; it must raise ``exc_type`` with ``fragment`` in the message."""
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        if fragment not in str(exc):
            raise AssertionError(f"{exc_type.__name__} without {fragment!r}: {exc}") from exc
        return exc
    raise AssertionError(f"{fn.__name__} did not raise {exc_type.__name__}")


def destroyed(rank: int, n: int) -> None:
    """Every use of a destroyed group handle names the destruction, instead of KeyError."""
    group = commrt.new_group(list(range(n)))
    t = np.ones(4, np.float32)
    commrt.all_reduce(t, group=group)  # destroyed right after: its last messages still arrive
    assert np.array_equal(t, np.full(4, float(n), np.float32)), "all_reduce on the group just before destroying it"
    commrt.destroy_process_group(group)
    t = np.ones(4, np.float32)
    expect(commrt.CommError, "destroyed", commrt.all_reduce, t, group=group)
    expect(commrt.CommError, "destroyed", commrt.broadcast, t, src=0, group=group)
    expect(commrt.CommError, "destroyed", commrt.barrier, group=group)
    expect(commrt.CommError, "destroyed", commrt.get_rank, group)
    if n > 1:
        expect(commrt.CommError, "destroyed", commrt.isend, t, dst=(rank + 1) % n, group=group)
    expect(commrt.CommError, "destroyed", commrt.destroy_process_group, group)
    commrt.all_reduce(t)  # the world is untouched
    assert np.array_equal(t, np.full(4, float(n), np.float32)), "world all_reduce after a group was destroyed"


def grad(rank: int, n: int) -> None:
    """Leaf tensors that require grad are updated in place, outside autograd, as in torch."""
    import torch  # the one mode on torch tensors; the others run on numpy, without torch's import
    from tests.multirank.programs.common import assert_equal, reference, values
    for numel in (5, 70001):  # small and ring paths
        parts = [values(numel, r, torch.float32, "SUM", numel) for r in range(n)]
        p = parts[rank].clone().requires_grad_(True)
        commrt.all_reduce(p)
        assert p.requires_grad and p.grad_fn is None and p.is_leaf
        assert_equal(p.detach(), reference(parts, "SUM"), f"all_reduce requires_grad n={numel}")
        p = parts[rank].clone().requires_grad_(True)
        commrt.broadcast(p, src=n - 1)
        assert_equal(p.detach(), parts[n - 1], f"broadcast requires_grad n={numel}")
        p = parts[rank].clone().requires_grad_(True)
        commrt.reduce(p, dst=0)
        assert_equal(p.detach(), reference(parts, "SUM") if rank == 0 else parts[rank], "reduce requires_grad")
        out = torch.zeros(numel * n, requires_grad=True)
        commrt.all_gather_into_tensor(out, parts[rank].clone().requires_grad_(True))
        assert_equal(out.detach(), torch.cat(parts), f"all_gather requires_grad n={numel}")
        shard = torch.zeros(numel // n, requires_grad=True)
        commrt.reduce_scatter_tensor(shard, parts[rank][:numel // n * n].clone().requires_grad_(True))
        want = reference([q[:numel // n * n] for q in parts], "SUM")[rank * (numel // n):(rank + 1) * (numel // n)]
        assert_equal(shard.detach(), want, f"reduce_scatter requires_grad n={numel}")
        loss = (p * 2).sum()  # autograd still works on the tensor afterwards
        loss.backward()
        assert_equal(p.grad, torch.full((numel,), 2.0), "grad after a collective")


def _crossed_roots(rank: int) -> None:
    """Each rank believes it is broadcast's root: both only send. Over TCP the op used to return
    and the stray be caught at the next op; the root check before the tree (ops._agree_on_root)
    names both roots in the op itself, as shared memory does."""
    commrt.broadcast(np.ones(8, np.float32), src=rank)
    commrt.all_reduce(np.ones(8, np.float32))


def _crossed_destinations(rank: int) -> None:
    commrt.reduce(np.ones(8, np.float32), dst=1 - rank)
    commrt.barrier()


def _split_lengths(rank: int) -> None:
    """Rank 1 sends rank 0 one element where rank 0 expects two: on shared memory rank 0 read
    one stale element past rank 1's block, silently (the TCP path saw the piece's size). Over
    TCP rank 1 receives what it expects: rank 0's report reaches it at the barrier."""
    in_s, out_s = ([2, 2], [2, 2]) if rank == 0 else ([1, 3], [2, 3])
    out = np.zeros(sum(out_s), np.float32)
    commrt.all_to_all_single(out, np.arange(4, dtype=np.float32), out_s, in_s)
    commrt.barrier()


def _more_pieces(rank: int) -> None:
    """Rank 1 sends rank 0 three elements more than the one whole piece (default 4 MiB pieces)
    rank 0 expects, so two pieces: rank 0's receive was satisfied by the first, the op returned
    and the second was only caught at the next op. It must fail in the op, naming both ranks;
    rank 1, whose receive is right, hears rank 0's report at the barrier."""
    piece = (4 << 20) // 4
    in_s, out_s = ([1, 1], [1, piece]) if rank == 0 else ([piece + 3, 1], [1, 1])
    out = np.zeros(sum(out_s), np.float32)
    commrt.all_to_all_single(out, np.arange(sum(in_s), dtype=np.float32), out_s, in_s)
    if rank == 1:
        commrt.barrier()


def _empty_reduce(rank: int) -> None:
    """Rank 1 reduces no elements, the others 8: it sent nothing, went on to the barrier and
    waited there on rank 0, which waited in the reduce on it: both blamed the other as lost at
    the deadline (3 ranks). Rank 1 only sends in the reduce: the barrier hears the report."""
    commrt.reduce(np.ones(0 if rank == 1 else 8, np.float32), dst=0)
    commrt.barrier()


# case -> (what each rank runs; rank 1 is the one that disagrees, what the error must name)
MISMATCHES = {
    "max_vs_sum": (lambda r: commrt.all_reduce(np.ones(8, np.float32), op="MAX" if r else "SUM"),
                   ("reduce=SUM", "reduce=MAX")),
    "avg_vs_sum_ring": (lambda r: commrt.all_reduce(np.ones(70001, np.float32), op="AVG" if r else "SUM"),
                        ("reduce=SUM", "reduce=AVG")),
    "reduce_scatter_min": (lambda r: commrt.reduce_scatter_tensor(np.ones(4, np.float32), np.ones(8, np.float32),
                                                                  op="MIN" if r else "SUM"),
                           ("reduce=SUM", "reduce=MIN")),
    "reduce_max": (lambda r: commrt.reduce(np.ones(8, np.float32), dst=0, op="MAX" if r else "SUM"),
                   ("reduce=SUM", "reduce=MAX")),
    # an integer AVG sums on a 64-bit copy (backends.base.widened): the headers still name the
    # caller's dtype, as every other op's do
    "avg_int8_vs_int64": (lambda r: commrt.all_reduce(np.full(8, 100, np.int8 if r else np.int64), op="AVG"),
                          ("dtype=int64", "dtype=int8")),
    # bool and uint8 are one byte each but not one op (SUM: a logical or, a sum)
    "bool_vs_uint8": (lambda r: commrt.all_reduce(np.ones(8, np.bool_ if r else np.uint8)),
                      ("dtype=uint8", "dtype=bool")),
    "broadcast_roots": (_crossed_roots, ("root=0", "root=1", "op=broadcast", "seq=2")),
    "reduce_roots": (_crossed_destinations, ("root=0", "root=1", "op=reduce", "seq=2")),
    "all_to_all_lengths": (_split_lengths, ("all_to_all", "rank 0 runs", "rank 1 runs")),
    "all_to_all_more_pieces": (_more_pieces, ("op=all_to_all", "count=1048576", "count=1048579", "rank 0 runs",
                                              "rank 1 runs")),
    # over TCP the root check's ring hop meets it first: rank 2 hears rank 1's empty header
    "empty_reduce": (_empty_reduce, ("op=reduce", "count=0", "count=8", "rank 1 runs")),
}


def mismatch(rank: int, n: int, case: str) -> None:
    """Two ranks disagreeing about the reduce op or the root get a CollectiveMismatch naming
    both sides (issue 13.5), instead of a wrong result; the group is unusable afterwards."""
    run, fragments = MISMATCHES[case]
    exc = expect(commrt.CollectiveMismatch, "collective mismatch", run, rank)
    missing = [f for f in fragments if f not in str(exc)]
    assert not missing, f"{missing} not in: {exc}"
    assert "corrupt" not in str(exc), f"a rank's own header called corrupt: {exc}"


def tags(rank: int, n: int) -> None:
    """A tag the wire cannot carry is refused at the call, on both ends (issue 13.6); so is an
    all_to_all whose block to itself has another length sent than expected (numpy's broadcast
    error once, raised on one rank after its peers had started; our backend's check)."""
    t = np.ones(4, np.float32)
    if commrt.get_backend() == "zmq":
        expect(ValueError, f"rank {rank} sends itself 2 elements but expects 1", commrt.all_to_all_single,
               np.zeros(3, np.float32), np.zeros(4, np.float32), [2, 1] if rank else [1, 2], [2, 2])
    for bad in (2 ** 62, -1):
        expect(ValueError, "0 <= tag < 2**62", commrt.isend, t, dst=1 - rank, tag=bad)
        expect(ValueError, "0 <= tag < 2**62", commrt.irecv, t, src=1 - rank, tag=bad)
    expect(TypeError, "tag must be an integer", commrt.isend, t, dst=1 - rank, tag=1.5)
    big = 2 ** 62 - 1 if commrt.get_backend() == "zmq" else 2 ** 31 - 1  # torch's tags are C ints
    if rank == 0:
        commrt.send(np.arange(4, dtype=np.float32), dst=1, tag=big)
    else:
        got = np.zeros(4, np.float32)
        commrt.recv(got, src=0, tag=big)
        assert np.array_equal(got, np.arange(4, dtype=np.float32)), "send/recv with the largest tag"


def init() -> tuple[int, int]:
    commrt.init_process_group()
    return commrt.get_rank(), commrt.get_world_size()


MODES = {"destroyed": destroyed, "grad": grad, "mismatch": mismatch, "tags": tags}


def main() -> None:
    mode = sys.argv[1]
    rank, n = init()
    MODES[mode](rank, n, *sys.argv[2:])
    if mode != "mismatch":
        commrt.barrier()
    commrt.destroy_process_group()
    print(f"misuse {mode} ok", flush=True)


if __name__ == "__main__":
    main()
