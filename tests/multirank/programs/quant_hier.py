"""Quantized collectives on a 2 x 2 layout (forced by the launcher's node variables): the
world's calls take the two-hop path (exact inside the node, quantized across) and equal, bit
for bit on every rank, a single-process reference of the same steps; within the codec's bound
of the fp64 result; sub-groups stay flat; a non-finite input fails every rank, none hangs."""
from __future__ import annotations

import numpy as np
import torch

import commrt
import commrt.quant as cq
import commrt.quant.hierarchical as two_hop
from commrt.collectives.algorithms import chunk_bounds

K = M = 2
SIZES = (0, 1, 7, 1003, 20000, 70001)


def qd(codec, x: np.ndarray) -> np.ndarray:
    """dequant(quant(x)) as one encoded chunk (blocks counted from its start)."""
    buf = np.empty(codec.nbytes(x.size), dtype=np.uint8)
    codec.encode_into(buf, x)
    return codec.decode(buf, x.size)


def ref_all_reduce(codec, parts: list[np.ndarray], avg: bool) -> np.ndarray:
    """The one-piece algorithm on each pipelined piece (two_hop.piece_bounds) in turn."""
    cuts = two_hop.piece_bounds(parts[0].size, K * M * codec.block)
    return np.concatenate([ref_piece(codec, [p[a:b] for p in parts], avg) for a, b in cuts])


def ref_piece(codec, parts: list[np.ndarray], avg: bool) -> np.ndarray:
    n, part = parts[0].size, -(-parts[0].size // M)
    padded = [np.concatenate([p, np.zeros(part * M - n, np.float32)]) for p in parts]
    out = []
    for l in range(M):  # local rank l: the node sums of its part, all-reduced across nodes
        sums = [padded[k * M][l * part:(l + 1) * part] + padded[k * M + 1][l * part:(l + 1) * part] for k in range(K)]
        shard = np.empty(part, np.float32)
        for a, b in chunk_bounds(part, K):
            acc = np.zeros(b - a, np.float32)
            for k in range(K):
                acc += qd(codec, sums[k][a:b])
            shard[a:b] = qd(codec, acc)
        out.append(shard / np.float32(K * M) if avg else shard)
    return np.concatenate(out)[:n]


def ref_reduce_scatter(codec, fulls: list[np.ndarray], s: int, rank: int, avg: bool) -> np.ndarray:
    k, l = divmod(rank, M)
    acc = np.zeros(s, np.float32)
    for node in range(K):  # chunk `rank` summed inside each node, then quantized once across
        c = rank * s
        acc += qd(codec, fulls[node * M][c:c + s] + fulls[node * M + 1][c:c + s])
    return acc / np.float32(K * M) if avg else acc


def inputs(numel: int, seed: int) -> list[np.ndarray]:
    out = []
    for r in range(K * M):
        v = np.random.default_rng(seed * 10 + r).standard_normal(numel).astype(np.float32)
        if numel > 5:
            v[numel // 2] = 40.0 * (r + 1)  # an outlier per rank: blocks of very different scales
        out.append(v)
    return out


def same_everywhere(flat_world, t: torch.Tensor, what: str) -> None:
    if t.numel() == 0:
        return
    raw = t.contiguous().view(-1).view(torch.uint8)
    got = torch.empty(raw.numel() * flat_world.size(), dtype=torch.uint8)
    commrt.all_gather_into_tensor(got, raw, group=flat_world)
    rows = got.view(flat_world.size(), -1)
    assert all(torch.equal(rows[0], r) for r in rows), f"{what}: ranks differ"


def within_bound(codec, got: np.ndarray, exact: np.ndarray, terms: int, what: str) -> None:
    """terms * s/2 with s the largest scale any encoded block can have (absmax / qmax)."""
    if exact.size:
        s = max(np.abs(exact).max() * 1.01, 1e-30) / codec.qmax
        err = np.abs(got.astype(np.float64) - exact).max()
        assert err <= terms * s / 2 + 1e-5 * np.abs(exact).max(), f"{what}: error {err} > {terms} x {s / 2}"


def check(flat_world, mode: str, dtype: torch.dtype) -> None:
    rank, codec = commrt.get_rank(), cq.codec_for(mode)
    for seed, n in enumerate(SIZES):
        for op in ("SUM", "AVG"):
            parts = inputs(n, seed)
            t = torch.from_numpy(parts[rank].copy()).to(dtype)
            if dtype != torch.float32:  # the reference starts from what the ranks hold
                parts = [torch.from_numpy(p).to(dtype).float().numpy() for p in parts]
            commrt.all_reduce(t, op=op, quant=mode)
            want = torch.from_numpy(ref_all_reduce(codec, parts, op == "AVG")).to(dtype)
            assert torch.equal(t, want), f"all_reduce {mode} {dtype} {op} {n}: {t[:4]} vs {want[:4]}"
            same_everywhere(flat_world, t, f"all_reduce {mode} {op} {n}")
            exact = np.sum([p.astype(np.float64) for p in parts], 0) / (K * M if op == "AVG" else 1)
            within_bound(codec, t.double().numpy(), exact, K * M + 1, f"all_reduce {mode} {n}")
            fulls = inputs(n * K * M, seed + 50)
            out = torch.empty(n)
            commrt.reduce_scatter_tensor(out, torch.from_numpy(fulls[rank]), op=op, quant=mode)
            want = ref_reduce_scatter(codec, fulls, n, rank, op == "AVG")
            assert np.array_equal(out.numpy(), want), f"reduce_scatter {mode} {op} {n}"
        gathered = torch.empty(n * K * M)
        commrt.all_gather_into_tensor(gathered, torch.from_numpy(parts[rank].copy()), quant=mode)
        want = np.concatenate([qd(codec, p) for p in parts])
        assert np.array_equal(gathered.numpy(), want), f"all_gather {mode} {n}"


def check_paths(flat_world) -> None:
    """The world went two-hop (and says so); a sub-group spanning the same ranks stays flat."""
    before = commrt.comm_stats()["quant"]
    t = torch.ones(1000)
    commrt.all_reduce(t, quant="int8", group=flat_world)
    after = commrt.comm_stats()["quant"]["all_reduce"]
    assert after["calls"] == before["all_reduce"]["calls"] + 1, after
    assert after["hierarchical_calls"] == before["all_reduce"]["hierarchical_calls"], after
    assert all(before[k]["hierarchical_calls"] == before[k]["calls"] > 0
               for k in ("all_reduce", "reduce_scatter", "all_gather")), before


def check_nonfinite() -> None:
    """Rank 3's NaN: every rank raises after the exchanges; the world still works after."""
    rank = commrt.get_rank()
    for call in ("all_reduce", "all_gather"):
        t = torch.ones(300)
        if rank == 3:
            t[17] = float("nan")
        try:
            if call == "all_reduce":
                commrt.all_reduce(t, quant="int4")
            else:
                commrt.all_gather_into_tensor(torch.empty(1200), t, quant="int4")
            raise AssertionError(f"{call}: a NaN on rank 3 was accepted")
        except ValueError as exc:
            assert rank != 3 or "element 17" in str(exc), exc
    t = torch.ones(300)
    commrt.all_reduce(t, quant="int8")
    assert torch.allclose(t, torch.full((300,), 4.0), rtol=1e-5), t[:4]


def check_pieces(flat_world) -> None:
    """The pipelined path: pieces of 4096+ values, the last one short (not a multiple of the
    block, nor of M), and a NaN in a later piece than the first."""
    two_hop.MIN_PIECE = 4096
    try:
        assert len(two_hop.piece_bounds(70001, K * M * 256)) == 8 and len(two_hop.piece_bounds(20000, 1024)) == 4
        for mode in ("int8", "int4"):
            check(flat_world, mode, torch.float32)
        rank = commrt.get_rank()
        t = torch.ones(30001)
        if rank == 2:
            t[25000] = float("inf")
        try:
            commrt.all_reduce(t, quant="int8")
            raise AssertionError("an inf on rank 2 was accepted")
        except ValueError as exc:
            assert rank != 2 or "element 25000" in str(exc), exc
        assert torch.equal(t[:4], torch.ones(4)) or rank == 2, "a failed call wrote its tensor"
    finally:
        two_hop.MIN_PIECE = 1 << 20


def check_default_groups() -> None:
    """hierarchical_all_reduce without groups runs over the world's node groups: the same bits
    as passing them (its defaults were the world twice, which summed unrelated shards)."""
    from commrt.topology import mesh
    intra, inter = mesh.node_groups()
    rank = commrt.get_rank()
    for n, op in ((1003, "SUM"), (4096, "AVG")):
        a = torch.from_numpy(inputs(n, 9)[rank])
        b = a.clone()
        cq.hierarchical_all_reduce(a, op=op, quant="int8")
        cq.hierarchical_all_reduce(b, op=op, intra_group=intra, inter_group=inter, quant="int8")
        assert torch.equal(a, b), f"default groups {n} {op}: {a[:4]} vs {b[:4]}"


def main() -> None:
    commrt.init_process_group()
    try:
        assert commrt.get_num_nodes() == K and commrt.get_local_world_size() == M
        flat_world = commrt.new_group(list(range(K * M)))  # not the world group: flat
        for mode in ("int8", "int4"):
            check(flat_world, mode, torch.float32)
        check(flat_world, "int8", torch.bfloat16)
        check_paths(flat_world)
        check_default_groups()
        check_nonfinite()
        check_pieces(flat_world)
        print(f"rank {commrt.get_rank()}: quant hier passed", flush=True)
    finally:
        commrt.destroy_process_group()


if __name__ == "__main__":
    main()
