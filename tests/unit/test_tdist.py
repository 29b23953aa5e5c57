"""The torch.distributed backend's pure parts: op translation, list flattening, the gather /
scatter split plans, and TorchWork's completion (future, copy-out, errors, timeouts)."""
import datetime
import threading

import pytest
import torch
import torch.distributed as dist

import commrt
from commrt.integrations.tdist import compose
from commrt.integrations.tdist.work import TorchWork
from commrt.runtime.dtypes import code_of
from commrt.runtime.work import CommTimeout, Work


def test_import_registers_the_backend_once_and_leaves_the_defaults():
    commrt.integrations.tdist.register_backend()
    commrt.integrations.tdist.register_backend()
    assert "commrt" in dist.Backend.backend_list and dist.Backend.backend_list.count("commrt") == 1
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"
    assert dist.Backend("commrt") == "commrt"


def test_monitored_barrier_wrapper_leaves_other_backends_to_torch():
    """``import commrt`` wraps dist.monitored_barrier once; a gloo group still gets torch's own
    function (one rank: it passes, a float timeout included)."""
    commrt.integrations.tdist.register_backend()
    assert dist.monitored_barrier.__commrt__ and dist.distributed_c10d.monitored_barrier is dist.monitored_barrier
    original = dist.monitored_barrier.__wrapped__
    assert not getattr(original, "__commrt__", False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=5))
        dist.monitored_barrier(timeout=5.0, wait_all_ranks=True)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("op,name", [(dist.ReduceOp.SUM, "SUM"), (dist.ReduceOp.AVG, "AVG"),
                                     (dist.ReduceOp.PRODUCT, "PRODUCT"), (dist.ReduceOp.MAX, "MAX"),
                                     (dist.ReduceOp.MIN, "MIN")])
def test_reduce_ops_map_to_commrt(op, name):
    assert compose.reduce_op(op).name == name
    opts = dist.distributed_c10d.AllreduceOptions()
    opts.reduceOp = op
    assert compose.reduce_op(opts.reduceOp).name == name


@pytest.mark.parametrize("op,name", [(dist.ReduceOp.SUM, "MAX"), (dist.ReduceOp.MAX, "MAX"),
                                     (dist.ReduceOp.PRODUCT, "MIN"), (dist.ReduceOp.MIN, "MIN")])
def test_bool_reductions_are_logical_on_bytes_and_cannot_wrap(op, name):
    """issue 30 item 6: a byte SUM of True wraps to False at 256 ranks; OR is MAX on 0/1 bytes."""
    assert compose.reduce_op(op, torch.bool).name == name
    assert compose.reduce_op(op, torch.uint8).name == compose.op_name(op)  # bytes keep their arithmetic
    assert compose.reduce_op(dist.ReduceOp.BOR, torch.bool) is None


def test_bool_avg_is_refused_by_name():
    with pytest.raises(ValueError, match="AVG is not defined for bool"):
        compose.reduce_op(dist.ReduceOp.AVG, torch.bool)


def test_bitwise_ops_fold_locally_and_premul_sum_is_refused():
    assert compose.reduce_op(dist.ReduceOp.BAND) is None
    rows = torch.tensor([[0b1100, 0b1010], [0b1010, 0b0110]])
    out = torch.empty(2, dtype=torch.int64)
    for op, want in ((dist.ReduceOp.BAND, [0b1000, 0b0010]), (dist.ReduceOp.BOR, [0b1110, 0b1110]),
                     (dist.ReduceOp.BXOR, [0b0110, 0b1100])):
        compose.fold(op, rows, out)
        assert out.tolist() == want
    with pytest.raises(NotImplementedError, match="PREMUL_SUM"):
        compose.reduce_op(dist._make_nccl_premul_sum(2.0))


def test_flat_cat_and_copy_out_round_trip_bool_and_shapes():
    tensors = [torch.tensor([[True, False]]), torch.tensor([False, True, True])]
    flat = compose.flat_cat(tensors)
    assert flat.dtype == torch.uint8 and flat.tolist() == [1, 0, 0, 1, 1]
    outs = [torch.zeros(1, 2, dtype=torch.bool), torch.zeros(3, dtype=torch.bool)]
    compose.copy_out(flat, outs)
    assert all(torch.equal(a, b) for a, b in zip(outs, tensors))
    with pytest.raises(TypeError, match="one dtype"):
        compose.same_dtype([torch.zeros(1), torch.zeros(1, dtype=torch.int32)], "alltoall")


def test_gather_plan_sends_only_to_the_root():
    assert compose.rooted_splits(3, 1, 0, [], 4) == ([0, 4, 0], [0, 0, 0])
    assert compose.rooted_splits(3, 1, 1, [2, 4, 6], 4) == ([0, 4, 0], [2, 4, 6])


def test_torch_work_completes_its_future_after_the_copy_out():
    a, b = Work("a"), Work("b")
    landed = []
    w = TorchWork("allgather", [a, b], ["result"], after=lambda: landed.append(1))
    assert not w.is_completed() and not w.get_future().done()
    a._finish(None, None)
    assert not w.is_completed()
    seen = threading.Event()
    w.get_future().then(lambda fut: seen.set())
    b._finish(None, None)
    assert w.is_completed() and landed == [1]
    assert w.wait() and w.get_future().value() == ["result"] and seen.wait(5)


def test_torch_work_future_callbacks_run_off_the_finishing_thread():
    """A ``then`` callback may wait for another operation of the group (torch's PowerSGD hook
    does): it must not run on the thread that finished the op (commrt's executor), which that
    operation needs. Here the callback waits for a Work that the finishing thread finishes
    only after its own callbacks return."""
    a, b = Work("a"), Work("b")
    w, w2 = TorchWork("allreduce", [a], ["first"]), TorchWork("allreduce", [b], ["second"])
    chained = w.get_future().then(lambda fut: w2.get_future().wait())

    def executor():  # finishes a, then b: like one group's executor thread
        a._finish(None, None)
        b._finish(None, None)
    t = threading.Thread(target=executor, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "the finishing thread is stuck in a future's callback"
    assert chained.wait() == ["second"]


def test_torch_work_hands_over_the_first_error_and_times_out_typed():
    a, b = Work("a"), Work("b")
    w = TorchWork("allreduce", [a, b], [])
    with pytest.raises(CommTimeout):
        w.wait(datetime.timedelta(milliseconds=10))
    lost = commrt.PeerLost(1, "all_reduce", 3, "gone")
    a._finish(None, lost)
    b._finish(None, None)
    with pytest.raises(commrt.PeerLost, match="rank 1"):
        w.wait()
    assert w.exception() is lost and not w.is_success()
    with pytest.raises(commrt.PeerLost):
        w.get_future().wait()
    c = Work("c")
    w = TorchWork("allreduce", [c], [])
    future = w.get_future()
    c._finish(None, lost)
    with pytest.raises(commrt.PeerLost):
        w.wait()
    assert future.done()  # settled (on another thread) by the time wait() raises


def test_done_callbacks_run_once_whether_added_before_or_after_finishing():
    w, calls = Work("x"), []
    w.add_done_callback(lambda _: calls.append("before"))
    w._finish(None, None)
    w.add_done_callback(lambda _: calls.append("after"))
    assert calls == ["before", "after"]


class _RecordingBackend:
    """Stands in for commrt's backend: records what the process group launches."""

    def __init__(self):
        self.calls = []

    def all_reduce(self, flat, op, async_op):
        self.calls.append(("all_reduce", flat.numel()))

    def reduce_scatter_tensor(self, out, flat, op, async_op):
        self.calls.append(("reduce_scatter_tensor", flat.numel()))

    def all_to_all_single(self, out, inp, out_splits, in_splits, async_op):
        self.calls.append(("all_to_all_single", inp.numel()))

    def all_gather_into_tensor(self, out, inp, async_op):
        self.calls.append(("all_gather_into_tensor", inp.numel()))


@pytest.mark.parametrize("out_size,blocks,match", [
    (3, [2, 3], "output has 3 elements, expected 2"),  # would silently take rank 1's first element
    (1, [2, 3], "output has 1 elements, expected 2"),
    (2, [2], "one input block per rank \\(2\\), got 1"),
])
def test_uneven_list_reduce_scatter_checks_the_output_size(out_size, blocks, match):
    """issue 30 item 21: the uneven path all-reduces and keeps ``out.numel()`` elements from our
    block's offset, so a wrong-sized output read into the next rank's block with no error."""
    from commrt.integrations.tdist.process_group import CommrtProcessGroup
    backend = _RecordingBackend()
    pg = CommrtProcessGroup(backend, 0, 2, [0, 1], lambda: None)
    ins = [torch.ones(n) for n in blocks]
    with pytest.raises(ValueError, match=match):
        pg.reduce_scatter([torch.zeros(out_size)], [ins])
    assert backend.calls == []  # refused before anything reached the wire
    out = torch.zeros(2)
    pg.reduce_scatter([out], [[torch.ones(2), torch.ones(3)]])  # the right size still runs
    assert backend.calls == [("all_reduce", 5)] and out.tolist() == [1.0, 1.0]


class _MirrorBackend:
    """A 2-rank backend whose peer holds the same values as this rank (rank 0): SUM doubles,
    MAX/MIN/AVG keep, an all-gather repeats. Refuses what commrt's wire refuses (code_of)."""

    def __init__(self):
        self.calls = []

    def _wire(self, *tensors):
        for t in tensors:
            code_of(t.dtype)

    def all_reduce(self, flat, op, async_op):
        self._wire(flat)
        self.calls.append(("all_reduce", op.name))
        if op.name == "SUM":
            flat.mul_(2)

    def all_gather_into_tensor(self, out, inp, async_op):
        self._wire(out, inp)
        self.calls.append(("all_gather_into_tensor", inp.numel()))
        out.view(-1).copy_(inp.reshape(-1).repeat(2))

    def reduce_scatter_tensor(self, out, inp, op, async_op):
        self._wire(out, inp)
        self.calls.append(("reduce_scatter_tensor", op.name))
        out.view(-1).copy_(inp.reshape(-1)[:out.numel()] * (2 if op.name == "SUM" else 1))


def _coalesced_reduce_scatter(pg, outs, ins, op):
    opts = dist.distributed_c10d.ReduceScatterOptions()
    opts.reduceOp = op
    opts.asyncOp = True
    pg.reduce_scatter_tensor_coalesced(outs, ins, opts).wait()


def test_coalesced_reduce_scatter_with_a_bitwise_op_folds_as_gloo_does():
    """A coalesced reduce_scatter_tensor (torch's _coalescing_manager) with BOR/BXOR/BAND handed
    commrt's backend op None: TypeError "int() argument ... not 'NoneType'" on every rank, where
    gloo reduces (found comparing every op with gloo at 2 ranks)."""
    from commrt.integrations.tdist.process_group import CommrtProcessGroup
    pg = CommrtProcessGroup(_MirrorBackend(), 0, 2, [0, 1], lambda: None)
    a, b, c = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.bool)
    ins = [torch.tensor([0b101, 0b011, 7, 7]), torch.tensor([0b110, 1, 7, 7]), torch.tensor([True, False, True, True])]
    _coalesced_reduce_scatter(pg, [a, b], ins[:2], dist.ReduceOp.BOR)
    assert a.tolist() == [0b101, 0b011] and b.tolist() == [0b110, 1]  # x | x = x, rank 0's block
    _coalesced_reduce_scatter(pg, [a, c], [ins[0], ins[2]], dist.ReduceOp.BXOR)
    assert a.tolist() == [0, 0] and c.tolist() == [False, False]  # x ^ x = 0


def test_complex_reduce_scatter_and_lists_travel_as_their_real_pairs():
    """reduce_scatter_tensor of a complex tensor was a TypeError ("complex64 is not supported")
    where gloo sums it (torch's Python layer views complex as real for all_reduce, all_gather and
    broadcast, not for reduce_scatter); complex MAX / PRODUCT are refused as torch refuses them."""
    from commrt.integrations.tdist.process_group import CommrtProcessGroup
    backend = _MirrorBackend()
    pg = CommrtProcessGroup(backend, 0, 2, [0, 1], lambda: None)
    out = torch.zeros(2, dtype=torch.complex64)
    pg._reduce_scatter_base(out, torch.tensor([1 + 2j, 3 - 1j, 5j, 6], dtype=torch.complex64))
    assert out.tolist() == [2 + 4j, 6 - 2j]
    outs = [torch.zeros(1, dtype=torch.complex128), torch.zeros(1, dtype=torch.complex128)]
    pg.allgather([outs], [torch.tensor([1 - 1j], dtype=torch.complex128)])
    assert [o.item() for o in outs] == [1 - 1j, 1 - 1j]
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT, dist.ReduceOp.BOR):
        with pytest.raises(ValueError, match="not defined for complex"):
            compose.reduce_op(op, torch.complex64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_bitwise_ops_on_floats_are_refused_before_any_traffic(dtype):
    """BAND/BOR/BXOR on a float tensor all-gathered it, then failed in the local fold with
    torch's NotImplementedError "bitwise_and_cpu not implemented for 'Float'" (gloo refuses
    such ops up front)."""
    from commrt.integrations.tdist.process_group import CommrtProcessGroup
    backend = _MirrorBackend()
    pg = CommrtProcessGroup(backend, 0, 2, [0, 1], lambda: None)
    opts = dist.distributed_c10d.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.BAND
    with pytest.raises(ValueError, match="BAND is not defined for floating-point"):
        pg.allreduce([torch.ones(3, dtype=dtype)], opts)
    assert backend.calls == []


@pytest.mark.parametrize("out_size,in_size", [(2, 5), (3, 4)])
def test_bitwise_reduce_scatter_tensor_checks_sizes_as_sum_does(out_size, in_size):
    """reduce_scatter_tensor with BAND/BOR/BXOR (an all-reduce of the input keeping our block)
    took any input size: 5 elements at 2 ranks into outputs of 2 silently dropped the last one
    (rank 0 [8, 9], rank 1 [10, 11], where gloo refuses), and an output of 3 from 4 ran the
    traffic, then failed on rank 1 only with "shape '[3]' is invalid for input of size 1"."""
    from commrt.integrations.tdist.process_group import CommrtProcessGroup
    backend = _MirrorBackend()
    pg = CommrtProcessGroup(backend, 1, 2, [0, 1], lambda: None)
    opts = dist.distributed_c10d.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.BAND
    want = f"input has {in_size} elements, expected output \\({out_size}\\) x world size"
    with pytest.raises(ValueError, match=want):
        pg._reduce_scatter_base(torch.zeros(out_size, dtype=torch.int64), torch.arange(in_size) + 8, opts)
    with pytest.raises(TypeError, match="one dtype"):
        pg._reduce_scatter_base(torch.zeros(2, dtype=torch.int32), torch.arange(4) + 8, opts)
    assert backend.calls == []
    out = torch.zeros(2, dtype=torch.int64)
    pg._reduce_scatter_base(out, torch.arange(4) + 8, opts)  # the right size still runs
    assert out.tolist() == [10, 11] and backend.calls == [("all_gather_into_tensor", 4)]


def test_list_ops_name_a_wrong_list_length_before_any_traffic():
    """gather/scatter/all_to_all/all_gather with a list of another length than the group size
    failed as the op they run as: "all_to_all_single: output split sizes [2] must be 2
    non-negative numbers summing to dim 0 (2)" for a gather with one output at 2 ranks (gloo:
    "Incorrect output list size 1")."""
    from commrt.integrations.tdist.process_group import CommrtProcessGroup
    backend = _RecordingBackend()
    pg = CommrtProcessGroup(backend, 0, 2, [0, 1], lambda: None)
    cases = [("gather", "output", 1, lambda: pg.gather([[torch.zeros(2)]], [torch.ones(2)])),
             ("scatter", "input", 3, lambda: pg.scatter([torch.zeros(2)], [[torch.ones(2)] * 3])),
             ("all_to_all", "input", 3, lambda: pg.alltoall([torch.zeros(1)] * 2, [torch.ones(1)] * 3)),
             ("all_to_all", "output", 1, lambda: pg.alltoall([torch.zeros(1)], [torch.ones(1)] * 2)),
             ("all_gather", "output", 3, lambda: pg.allgather([[torch.zeros(2)] * 3], [torch.ones(2)]))]
    for what, kind, n, call in cases:
        with pytest.raises(ValueError, match=f"{what} on rank 0 needs one {kind} tensor per rank \\(2\\), got {n}"):
            call()
    assert backend.calls == []
    pg.gather([[torch.zeros(2), torch.zeros(2)]], [torch.ones(2)])  # the right lengths still run
    opts = dist.distributed_c10d.ScatterOptions()
    opts.rootRank = 1  # not the root: no list to check
    pg.scatter([torch.zeros(2)], [], opts)
    assert [c[0] for c in backend.calls] == ["all_to_all_single"] * 2
