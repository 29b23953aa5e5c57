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
    stats = commrt.comm_stats()
    assert stats["quant"]["all_reduce"]["calls"] >= 4 and "intra_node_bytes" in stats, stats
    commrt.destroy_process_group()
    print(f"rank {rank}: quant api passed", flush=True)


if __name__ == "__main__":
    main()
