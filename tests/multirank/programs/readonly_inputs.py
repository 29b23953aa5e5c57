"""Inputs an op only reads may be read-only numpy arrays (np.frombuffer of bytes, a memory-mapped
file opened read-only): all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, a
send, broadcast's source and reduce's other ranks, against the single-process reference; a
read-only buffer an op writes is refused with a ValueError on every rank, before any rank
communicates. Also a read-only numpy input beside a
torch output. They used to be refused ("collectives update tensors in place") as inputs too.

    readonly_inputs
"""
from __future__ import annotations

import numpy as np

import commrt
from tests.multirank.programs.np_ref import reference, values


def read_only(a: np.ndarray) -> np.ndarray:
    return np.frombuffer(a.tobytes(), a.dtype)  # bytes: read-only memory


def main() -> None:
    commrt.init_process_group()
    rank, n = commrt.get_rank(), commrt.get_world_size()
    m = 9
    parts = [values(m * n, r, np.float32, "SUM", m) for r in range(n)]
    mine = read_only(parts[rank])
    assert not mine.flags.writeable

    out = np.zeros(m * n * n, np.float32)
    commrt.all_gather_into_tensor(out, mine)
    assert np.array_equal(out, np.concatenate(parts)), "all_gather_into_tensor"

    out = np.zeros(m, np.float32)
    commrt.reduce_scatter_tensor(out, mine)
    assert np.array_equal(out, reference(parts, "SUM")[rank * m:(rank + 1) * m]), "reduce_scatter_tensor"

    out = np.zeros(m * n, np.float32)
    commrt.all_to_all_single(out, mine)
    want = np.concatenate([parts[r][rank * m:(rank + 1) * m] for r in range(n)])
    assert np.array_equal(out, want), "all_to_all_single"

    if rank == 0:
        commrt.send(mine, dst=1)
    elif rank == 1:
        got = np.zeros(m * n, np.float32)
        commrt.recv(got, src=0)
        assert np.array_equal(got, parts[0]), "send / recv"

    import torch  # a tensor output beside a read-only numpy input: they run as tensors
    gathered = torch.zeros(m * n * n)
    commrt.all_gather_into_tensor(gathered, mine)
    assert np.array_equal(gathered.numpy(), np.concatenate(parts)), "all_gather, tensor output"

    # broadcast's source and reduce's other ranks only read their buffer: a read-only one was
    # refused on that rank alone, and its peers waited in the op until the deadline
    weights = read_only(parts[0]) if rank == 0 else np.zeros(m * n, np.float32)
    commrt.broadcast(weights, src=0)
    assert np.array_equal(weights, parts[0]), "broadcast from a read-only source"
    t = parts[rank].copy() if rank == n - 1 else read_only(parts[rank])
    commrt.reduce(t, dst=n - 1)
    assert np.array_equal(t, reference(parts, "SUM") if rank == n - 1 else parts[rank]), "reduce, read-only inputs"

    for name, call in (("all_reduce", lambda: commrt.all_reduce(read_only(parts[rank]))),
                       ("all_gather output", lambda: commrt.all_gather_into_tensor(read_only(parts[rank]), mine[:m]))):
        try:
            call()
        except ValueError as exc:
            assert "read-only" in str(exc), (name, exc)
        else:
            raise AssertionError(f"{name}: a read-only buffer it writes was accepted")
    t = parts[rank].copy()  # the group is intact: nobody sent anything for the refused ops
    commrt.all_reduce(t)
    assert np.array_equal(t, reference(parts, "SUM")), "all_reduce after the refusals"
    commrt.destroy_process_group()
    print(f"rank {rank}: read-only inputs passed", flush=True)


if __name__ == "__main__":
    main()
