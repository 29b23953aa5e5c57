"""The standard calls take ``quant=``: same results as commrt.quant's, MAX refused, stats kept."""
import torch

import commrt
import commrt.quant as cq


def main() -> None:
    commrt.init_process_group()
    rank, n = commrt.get_rank(), commrt.get_world_size()
    base = torch.linspace(-1, 1, 1003)
    for mode in ("int8", "int4"):
        a, b = base * (rank + 1), base * (rank + 1)
        commrt.all_reduce(a, op=commrt.ReduceOp.AVG, quant=mode)
        cq.all_reduce(b, op=commrt.ReduceOp.AVG, quant=mode)
        assert torch.equal(a, b), f"all_reduce(quant={mode}) differs from commrt.quant's"
        out, ref = torch.empty(1003 * n), torch.empty(1003 * n)
        commrt.all_gather_into_tensor(out, base * rank, quant=mode)
        cq.all_gather_into_tensor(ref, base * rank, quant=mode)
        assert torch.equal(out, ref), f"all_gather(quant={mode}) differs"
        rs, rs_ref = torch.empty(7), torch.empty(7)
        commrt.reduce_scatter_tensor(rs, torch.arange(7.0 * n), quant=mode)
        cq.reduce_scatter_tensor(rs_ref, torch.arange(7.0 * n), quant=mode)
        assert torch.equal(rs, rs_ref), f"reduce_scatter(quant={mode}) differs"
    try:
        commrt.all_reduce(base.clone(), op=commrt.ReduceOp.MAX, quant="int8")
        raise AssertionError("MAX with quant was accepted")
    except ValueError as exc:
        assert "SUM" in str(exc)
    feedback_untouched_by_a_failed_call(rank)
    an_overflowing_sum_is_named(rank)
    stats = commrt.comm_stats()
    assert stats["quant"]["all_reduce"]["calls"] >= 4 and "intra_node_bytes" in stats, stats
    commrt.destroy_process_group()
    print(f"rank {rank}: quant api passed", flush=True)


def feedback_untouched_by_a_failed_call(rank: int) -> None:
    """A NaN in rank 0's own chunk: rank 0 marks it in the reduce-scatter hop, every rank learns
    of it in the all-gather hop and raises. Ranks 1 and 2 had no problem in the first hop and
    used to update their error memory there: after the failed call (which writes nothing) it
    held a residual of values never sent, unlike rank 0's."""
    fb = cq.ErrorFeedback(err_beta=0.5)
    x = torch.linspace(-1, 1, 1003) * (rank + 1)
    cq.all_reduce(x.clone(), quant="int4", feedback=fb)
    before = {stage: fb.error(stage) for stage in ("send", "shard")}
    bad = x.clone()
    if rank == 0:
        bad[3] = float("nan")
    try:
        cq.all_reduce(bad, quant="int4", feedback=fb)
        raise AssertionError("a NaN was quantized")
    except ValueError as exc:
        assert "nothing was written" in str(exc), exc
    for stage, err in before.items():
        assert (fb.error(stage) == err).all(), f"rank {rank}: a failed all_reduce changed the '{stage}' error memory"


def an_overflowing_sum_is_named(rank: int) -> None:
    """Finite inputs whose fp32 sum overflows: the reduced shard cannot be encoded for the
    all-gather hop. The error named "a non-finite value: element 0 is inf", as if the caller
    had passed one; it now says the sum overflowed (on the ranks whose shard did; the others
    name the rank that raised)."""
    try:
        cq.all_reduce(torch.full((30,), 3e38), quant="int8")
        raise AssertionError("an overflowing sum was quantized")
    except ValueError as exc:
        assert "of finite inputs overflowed" in str(exc) or "sent values that cannot be quantized" in str(exc), exc
        if rank == 0:
            assert "of finite inputs overflowed" in str(exc), exc


if __name__ == "__main__":
    main()
