"""API misuse that must end in a clear typed error (or, for grad-requiring tensors, just work),
checked on real ranks. ``python -m tests.multirank.programs.misuse <mode>``; every rank prints
'misuse <mode> ok' when its checks passed."""
from __future__ import annotations

import sys

import torch

import commrt
from tests.multirank.programs.common import assert_equal, init, reference, values


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
    commrt.all_reduce(torch.ones(4), group=group)
    commrt.destroy_process_group(group)
    t = torch.ones(4)
    expect(commrt.CommError, "destroyed", commrt.all_reduce, t, group=group)
    expect(commrt.CommError, "destroyed", commrt.broadcast, t, src=0, group=group)
    expect(commrt.CommError, "destroyed", commrt.barrier, group=group)
    expect(commrt.CommError, "destroyed", commrt.get_rank, group)
    if n > 1:
        expect(commrt.CommError, "destroyed", commrt.isend, t, dst=(rank + 1) % n, group=group)
    expect(commrt.CommError, "destroyed", commrt.destroy_process_group, group)
    commrt.all_reduce(t)  # the world is untouched
    assert_equal(t, torch.full((4,), float(n)), "world all_reduce after a group was destroyed")


def grad(rank: int, n: int) -> None:
    """Leaf tensors that require grad are updated in place, outside autograd, as in torch."""
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


MODES = {"destroyed": destroyed, "grad": grad}


def main() -> None:
    mode = sys.argv[1]
    rank, n = init()
    MODES[mode](rank, n)
    commrt.barrier()
    commrt.destroy_process_group()
    print(f"misuse {mode} ok", flush=True)


if __name__ == "__main__":
    main()
