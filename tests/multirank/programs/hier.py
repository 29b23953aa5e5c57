"""Topology getters, the device mesh and the hierarchical collectives on a K x M layout.

argv: expected nodes, ranks per node, then "matrix" | "bytes" | "mesh" | "links" | ... (one or
several). Every result is compared with a single-process reference built from every rank's
(deterministic) inputs; every rank's result bytes are compared through a flat group spanning the
world.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import commrt


def _same_everywhere(flat_world, t, what: str) -> None:
    import torch
    raw = t.contiguous().view(-1).view(torch.uint8)
    got = torch.empty(raw.numel() * flat_world.size(), dtype=torch.uint8)
    commrt.all_gather_into_tensor(got, raw, group=flat_world)
    rows = got.view(flat_world.size(), -1)
    assert all(torch.equal(rows[0], rows[r]) for r in range(len(rows))), f"{what}: ranks differ"


def check_layout(k: int, m: int, train: bool) -> None:
    """``train``: also the training layer's view (it imports torch: the modes on torch only)."""
    rank = commrt.get_rank()
    assert commrt.get_num_nodes() == k, commrt.get_num_nodes()
    assert commrt.get_local_world_size() == m
    assert commrt.get_node_rank() == rank // m and commrt.get_local_rank() == rank % m
    if train:
        from commrt.train import groups  # hybrid sharding's default group: the node, from the topology
        assert groups.ranks_per_node() == m, groups.ranks_per_node()


def check_mesh(k: int, m: int) -> None:
    rank, world = commrt.get_rank(), commrt.get_world_size()
    mesh = commrt.init_device_mesh((k, m), ("inter", "intra"))
    assert commrt.get_process_group_ranks(mesh.get_group("intra")) == list(range(rank // m * m, rank // m * m + m))
    assert commrt.get_process_group_ranks(mesh.get_group("inter")) == list(range(rank % m, world, m))
    t = np.array([float(rank)], np.float32)
    commrt.all_reduce(t, group=mesh.get_group("intra"))
    assert t[0] == sum(range(rank // m * m, rank // m * m + m)), t
    for shape in ((world, 1), (1, world), (m, k)):  # any 2-D shape that multiplies to the world
        other = commrt.init_device_mesh(shape, ("a", "b"))
        rows = commrt.get_process_group_ranks(other.get_group("b"))
        assert rows == list(range(rank // shape[1] * shape[1], rank // shape[1] * shape[1] + shape[1])), rows
    assert commrt.get_process_group_ranks() == list(range(world))


def check_matrix(flat_world) -> None:
    import torch  # every torch dtype (bfloat16 among them) and nn.Parameter
    from tests.multirank.programs.common import DTYPES, OPS, assert_equal, reference, values
    rank, world = commrt.get_rank(), commrt.get_world_size()
    check_half_avg(flat_world, rank, world)
    check_bool(rank, world)
    for seed, (dtype, op) in enumerate((d, o) for d in DTYPES for o in OPS):
        for numel in (0, 1, 7, 3 * world + 1, 20_001):  # empty, below, around and above the padding
            parts = [values(numel, r, dtype, op, seed) for r in range(world)]
            want = reference(parts, op)
            t = parts[rank].clone()
            work = commrt.all_reduce(t, op=op, async_op=numel == 7)
            if work is not None:
                work.wait()
            # a half AVG's parts / n round unless n is a power of two: equal within rounding
            rounds = op == "AVG" and dtype in (torch.float16, torch.bfloat16) and world & (world - 1)
            same = assert_equal if rounds else _exactly
            same(t, want, f"all_reduce {dtype} {op} {numel}")
            if numel:
                _same_everywhere(flat_world, t, f"all_reduce {dtype} {op} {numel}")
            chunk = numel
            full = [values(chunk * world, r, dtype, op, seed + 7) for r in range(world)]
            out = torch.empty(chunk, dtype=dtype)
            commrt.reduce_scatter_tensor(out, full[rank], op=op)
            same(out, reference(full, op)[rank * chunk:(rank + 1) * chunk], f"RS {dtype} {op}")
        gathered = torch.empty(5 * world, dtype=dtype)
        commrt.all_gather_into_tensor(gathered, values(5, rank, dtype, "SUM", seed))
        assert torch.equal(gathered, torch.cat([values(5, r, dtype, "SUM", seed) for r in range(world)]))
    rng = np.random.default_rng(rank)  # floats that round: equal within rounding, identical on all
    x = torch.from_numpy(rng.standard_normal(100_003))
    parts = [torch.from_numpy(np.random.default_rng(r).standard_normal(100_003)) for r in range(world)]
    commrt.all_reduce(x)
    np.testing.assert_allclose(x.numpy(), torch.stack(parts).sum(0).numpy(), rtol=1e-12, atol=1e-12)
    _same_everywhere(flat_world, x, "float64 random all_reduce")
    check_parameters(rank, world)


def _exactly(got, want, what: str) -> None:
    import torch
    assert torch.equal(got, want), f"{what}: {got[:8]} vs {want[:8]}"


def check_half_avg(flat_world, rank: int, world: int) -> None:
    """float16 AVG of values whose sum passes 65504 while their mean fits (programs/half_avg.py),
    over the two levels: the node's sums used to overflow to inf."""
    import torch
    from tests.multirank.programs.half_avg import quarters
    for numel in (1, 3 * world + 1, 20_001):
        t = torch.from_numpy(quarters(numel, rank, world, numel) * world).half()
        commrt.all_reduce(t, op="avg")
        _exactly(t, torch.from_numpy(sum(quarters(numel, r, world, numel) for r in range(world))).half(),
                 f"float16 AVG near the top, {numel}")
        _same_everywhere(flat_world, t, "float16 AVG near the top")
        full = [quarters(numel * world, r, world, numel) for r in range(world)]
        out = torch.empty(numel, dtype=torch.float16)
        commrt.reduce_scatter_tensor(out, torch.from_numpy(full[rank] * world).half(), op="avg")
        _exactly(out, torch.from_numpy(sum(full)[rank * numel:(rank + 1) * numel]).half(),
                 f"float16 AVG reduce_scatter near the top, {numel}")


def check_bool(rank: int, world: int) -> None:
    """bool over the two levels: SUM a logical or, PRODUCT a logical and; AVG a ValueError on
    every rank (it went two levels, then failed dividing a bool by the world size)."""
    import torch
    for op, want in (("SUM", [True, True, False]), ("PRODUCT", [False, True, False])):
        t = torch.tensor([rank == 0, True, False]).repeat(7)
        commrt.all_reduce(t, op=op)
        assert t.tolist() == want * 7, (op, t)
        out = torch.zeros(3, dtype=torch.bool)
        commrt.reduce_scatter_tensor(out, torch.tensor([rank == 0, True, False]).repeat(world), op=op)
        assert out.tolist() == want, (op, out)
    try:
        commrt.all_reduce(torch.ones(8, dtype=torch.bool), op="avg")
    except ValueError as exc:
        assert "AVG" in str(exc) and "bool" in str(exc), exc
    else:
        raise AssertionError("AVG of bools over two levels did not raise")


def check_parameters(rank: int, world: int) -> None:
    """Tensors that require grad are reduced in place outside autograd, as on one level
    (issue 30.5: a 7-element nn.Parameter raised on two levels, and AVG left the SUM behind)."""
    import torch
    for op in ("SUM", "AVG"):
        p = torch.nn.Parameter(torch.arange(7, dtype=torch.float32) + rank)
        commrt.all_reduce(p, op=op)
        want = sum(torch.arange(7, dtype=torch.float32) + r for r in range(world))
        assert torch.equal(p.detach(), want / world if op == "AVG" else want), (op, p)
        assert p.requires_grad and p.grad is None


def _delta(before: dict, after: dict) -> tuple[int, int]:
    return (after["intra_node_bytes"] - before["intra_node_bytes"],
            after["inter_node_bytes"] - before["inter_node_bytes"])


def check_bytes(flat_world, k: int, m: int) -> None:
    """Each rank's intra/inter bytes for one op equal the algorithms' formulas."""
    rank, world = commrt.get_rank(), commrt.get_world_size()
    n = 3 << 20  # bytes (and n // 4 elements) divisible by 2, 3, 4, 6 and 12; each level on its ring path
    t = np.ones(n // 4, np.float32)
    commrt.all_reduce(t)  # makes the node groups first, outside the measurement
    s0 = commrt.comm_stats()
    commrt.all_reduce(t)
    hier = _delta(s0, commrt.comm_stats())
    assert hier == (2 * (m - 1) * n // m, 2 * (k - 1) * n // (k * m)), (hier, k, m)
    s0 = commrt.comm_stats()
    commrt.all_reduce(t, group=flat_world)
    flat = _delta(s0, commrt.comm_stats())
    assert sum(flat) == 2 * (world - 1) * n // world, flat
    totals = np.array([float(flat[1])])
    commrt.all_reduce(totals, group=flat_world)
    assert totals[0] == k * 2 * (world - 1) * n // world, (totals[0], flat)  # K boundary crossings
    out = np.empty(n // 4 // world, np.float32)
    s0 = commrt.comm_stats()
    commrt.reduce_scatter_tensor(out, t)
    assert _delta(s0, commrt.comm_stats()) == ((m - 1) * n // m, (k - 1) * n // (k * m))
    stats = commrt.comm_stats()
    assert {"all_reduce", "reduce_scatter", "all_gather"} <= set(stats["by_op"]), stats
    print(f"rank {rank}: BYTES hier {hier} flat {flat}", flush=True)


def check_links(k: int, m: int) -> None:
    """The bandwidths "auto" sharding weighs, measured over the two-level groups, and its choice."""
    import torch
    from commrt.train import groups, sharding
    from commrt.train.config import TrainConfig
    links = groups.measure_links()
    z = TrainConfig.from_dict({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": "auto"}}).zero
    p = sharding.plan(z, k * m, m, links)
    print(f"rank {commrt.get_rank()}: LINKS intra {links.intra:.0f} inter {links.inter:.0f} hpz {p.secondary}",
          flush=True)
    # [comm] hierarchical = "auto": nothing measured until a world collective could go either way
    assert commrt.comm_stats()["hierarchical_auto"] is None
    t = torch.arange(1 << 18, dtype=torch.float64)  # 2 MiB: each rank's part across is above small_bytes
    commrt.all_reduce(t)
    assert torch.equal(t, torch.arange(1 << 18, dtype=torch.float64) * k * m)
    auto = commrt.comm_stats()["hierarchical_auto"]
    s0 = commrt.comm_stats()
    commrt.all_reduce(t)
    steps = set(commrt.comm_stats()["by_op"]) - {op for op, v in s0["by_op"].items()
                                                 if v == commrt.comm_stats()["by_op"][op]}
    print(f"rank {commrt.get_rank()}: AUTO {auto['hierarchical']} flat {auto['flat_s']:.6f} "
          f"two {auto['hierarchical_s']:.6f} steps {sorted(steps)}", flush=True)


def check_sizes(k: int, m: int) -> None:
    """[comm] hierarchical = "auto" with two levels chosen (preset here: the probe is not under
    test): rank 0 all_reduces 2 MiB, the others 1 KiB. Each rank routed by its own size, rank 0
    to the node groups and the rest to the flat world, where no header met another: every rank
    waited out the deadline. Every rank must raise CollectiveMismatch naming the op instead."""
    from commrt.runtime import world
    from commrt.topology import dispatch
    world.current().extras["hierarchical_auto"] = dispatch.AutoChoice(True, 1.0, 0.5, 0)
    big = np.ones(1 << 18, np.float64)  # 2 MiB: each rank's part across is above small_bytes
    commrt.all_reduce(big)  # every rank two levels: the node groups exist on every rank
    assert np.array_equal(big, np.full_like(big, k * m))
    mine = np.ones(1 << 18 if commrt.get_rank() == 0 else 128, np.float64)
    started = time.monotonic()
    try:
        commrt.all_reduce(mine)
    except commrt.CollectiveMismatch as exc:
        assert "all_reduce" in str(exc), exc
        print(f"rank {commrt.get_rank()}: CAUGHT CollectiveMismatch after {time.monotonic() - started:.2f}s: {exc}",
              flush=True)
        return
    raise AssertionError(f"rank {commrt.get_rank()}: an all_reduce of other sizes on other ranks completed")


def check_strided() -> None:
    """Even ranks hand the two-level ops strided views, odd ranks contiguous arrays, of the same
    values: every rank must take the same path (a strided rank used to go the flat way alone,
    and the others waited for it), and the views get the results. Inputs that are only read are
    read-only arrays; a read-only all_reduce buffer is refused on every rank."""
    from tests.multirank.programs.np_ref import reference, values
    rank, world = commrt.get_rank(), commrt.get_world_size()

    def laid_out(a: np.ndarray, read_only: bool = False) -> np.ndarray:
        if rank % 2:
            out = a.copy()
        else:
            room = np.zeros((a.size, 3), a.dtype)
            room[:, 1] = a
            out = room[:, 1]  # every third element: not contiguous
        out.flags.writeable = not read_only  # an input only read may be read-only (dtypes.as_buffer)
        return out

    for numel in (1, 7, 4099):
        parts = [values(numel, r, np.float32, "SUM", numel) for r in range(world)]
        t = laid_out(parts[rank])
        commrt.all_reduce(t)
        assert np.array_equal(t, reference(parts, "SUM")), f"all_reduce {numel}"
        full = [values(numel * world, r, np.int32, "MAX", numel) for r in range(world)]
        out = laid_out(np.zeros(numel, np.int32))
        commrt.reduce_scatter_tensor(out, laid_out(full[rank], read_only=True), op="max")
        assert np.array_equal(out, reference(full, "MAX")[rank * numel:(rank + 1) * numel]), f"RS {numel}"
        gathered = laid_out(np.zeros(numel * world, np.float32))
        commrt.all_gather_into_tensor(gathered, laid_out(parts[rank], read_only=True))
        assert np.array_equal(gathered, np.concatenate(parts)), f"all_gather {numel}"
        try:  # every rank refuses a read-only output before any level starts: no rank waits
            commrt.all_reduce(laid_out(parts[rank], read_only=True))
        except ValueError as exc:
            assert "read-only" in str(exc), exc
        else:
            raise AssertionError("a read-only all_reduce buffer was accepted")
    check_mixed_kinds(rank, world)


def check_mixed_kinds(rank: int, world: int) -> None:
    """Odd ranks hand all_gather / reduce_scatter a torch output beside a numpy input (they run
    as tensors, backends.base.same_kind), even ranks numpy arrays: the same path for all (the
    mixed ranks used to go the flat way alone, their dtypes being numpy's and torch's)."""
    import torch
    from tests.multirank.programs.np_ref import reference, values
    numel = 5
    kind = (lambda a: torch.from_numpy(a)) if rank % 2 else (lambda a: a)  # noqa: E731
    parts = [values(numel, r, np.float32, "SUM", 3) for r in range(world)]
    gathered = kind(np.zeros(numel * world, np.float32))
    commrt.all_gather_into_tensor(gathered, parts[rank].copy())
    assert np.array_equal(np.asarray(gathered), np.concatenate(parts)), "all_gather, mixed kinds"
    full = [values(numel * world, r, np.float32, "SUM", 4) for r in range(world)]
    out = kind(np.zeros(numel, np.float32))
    commrt.reduce_scatter_tensor(out, full[rank].copy())
    assert np.array_equal(np.asarray(out), reference(full, "SUM")[rank * numel:(rank + 1) * numel]), "RS, mixed kinds"


def main() -> None:
    """argv[3:]: one mode, or "matrix strided" (one launch for both: each launch imports torch)."""
    k, m, modes = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    if os.environ.get("COMMRT_TEST_SWAP_GROUP_RANK") == os.environ["RANK"]:
        os.environ["GROUP_RANK"] = "1"  # this rank claims another node: not contiguous
    if os.environ.get("COMMRT_TEST_DROP_NODE_VARS"):  # the layout must come from the hosts alone
        for name in ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(name)
    if "bytes" in modes:  # check_bytes's formulas are the ring's (the table takes Rabenseifner at 3 MiB)
        os.environ["COMMRT_COMM_ALGORITHMS"] = "all_reduce=ring"
    commrt.init_process_group()
    try:
        check_layout(k, m, train=bool({"matrix", "links"} & set(modes)))
        flat_world = commrt.new_group(list(range(commrt.get_world_size())))  # not the world: flat
        for what in modes:
            if what == "mesh":
                check_mesh(k, m)
            elif what == "links":
                check_links(k, m)
            elif what == "sizes":
                check_sizes(k, m)
                return
            elif what == "matrix":
                check_matrix(flat_world)
            elif what == "strided":
                check_strided()
            else:
                check_bytes(flat_world, k, m)
            print(f"rank {commrt.get_rank()}: hier {what} passed", flush=True)
    finally:
        commrt.destroy_process_group()


if __name__ == "__main__":
    main()
