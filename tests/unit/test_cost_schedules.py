"""plan/cost.py predicts the bytes of the schedule the selection table picks (issue 32): its
(intra, inter) figures for all_reduce and all_gather equal, byte for byte, what ops.py sends when
run on threads (test_scheduled's in-memory ranks), for every table choice and a pinned ring,
with the ranks laid out on nodes of 1, 2 and 3."""
import pytest
import torch

from commrt.collectives import ops
from commrt.collectives.reduce_ops import ReduceOp
from commrt.collectives.selection import choose, table_from
from commrt.plan import cost
from tests.unit.test_scheduled import run_ranks

TABLES = {"table": table_from(None), "ring": table_from({"all_reduce": "ring", "all_gather": "ring"})}


def measured(n: int, per_node: int, table, body) -> tuple[float, float]:
    """Mean bytes a rank sent inside its node and across, as the threads counted them."""
    sent = [0, 0]
    for r, (bytes_to, _) in enumerate(run_ranks(n, torch.int8, table, body, piece_elems=1 << 20)):
        for dst, nbytes in bytes_to.items():
            sent[r // per_node != dst // per_node] += nbytes
    return sent[0] / n, sent[1] / n


@pytest.mark.parametrize("table", list(TABLES))
@pytest.mark.parametrize("n, per_node", [(2, 1), (3, 1), (4, 2), (5, 2), (6, 3), (8, 2), (8, 4)])
def test_predicted_bytes_are_the_bytes_the_schedule_sends(table, n, per_node):
    net = cost.Net(n // per_node, per_node, table=TABLES[table])
    ranks = cost.group(0, n)
    for nbytes in (1, 4099, 20 << 10):  # fewer bytes than ranks; recursive doubling; Rabenseifner
        def reduce(ctx):
            ops.all_reduce(ctx, torch.ones(nbytes, dtype=torch.int8), ReduceOp.SUM)
            return ctx.bytes_to
        t = cost.Traffic()
        cost.flat(t, "all_reduce", ranks, nbytes, net)
        got = measured(n, per_node, TABLES[table], reduce)
        assert tuple(t.by_op["all_reduce"]) == pytest.approx(got), (choose("all_reduce", nbytes, n, net.table), nbytes)

        m = -(-nbytes // n)  # all_gather: the output of n parts of m

        def gather(ctx):
            ops.all_gather(ctx, torch.zeros(n * m, dtype=torch.int8), torch.ones(m, dtype=torch.int8))
            return ctx.bytes_to
        t = cost.Traffic()
        cost.flat(t, "all_gather", ranks, n * m, net)
        assert tuple(t.by_op["all_gather"]) == pytest.approx(measured(n, per_node, TABLES[table], gather)), nbytes


def test_the_table_changes_the_prediction():
    """4 KiB over 8 ranks, 2 per node: recursive doubling sends log2 8 = 3 whole buffers, one of
    them inside the node; the direct exchange this replaced was predicted at 7 (1 inside)."""
    t = cost.Traffic()
    cost.flat(t, "all_reduce", cost.group(0, 8), 4096, cost.Net(4, 2))
    assert t.by_op["all_reduce"] == [4096, 2 * 4096]
