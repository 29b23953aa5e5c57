"""The gloo/nccl teardown handshake (bootstrap._leave_together) on a real store shared by
several runtimes, as replica groups and the benchmark's backends share one under their own
namespaces: each world's rank 0 must wait for its own world's ranks, not count an earlier one's."""
import time
import types

from commrt.runtime import bootstrap


def _runtime(store, namespace: str, rank: int, lost=()):
    """What _leave_together reads of a Runtime: its store, namespace, world and groups."""
    world = types.SimpleNamespace(rank=rank, size=lambda: 2, backend=types.SimpleNamespace(lost=lost))
    return types.SimpleNamespace(store=store, namespace=namespace, world=world, groups=[])


def _leave(store, namespace: str, rank: int, within_s: float, lost=()) -> float:
    start = time.monotonic()
    bootstrap._leave_together(_runtime(store, namespace, rank, lost), within_s)
    return time.monotonic() - start


def test_a_later_world_on_a_shared_store_waits_for_its_own_ranks(store):
    client = store()
    assert _leave(client, "g0/", 1, 5.0) < 1.0 and _leave(client, "g0/", 0, 5.0) < 1.0  # both left
    # the next world's rank 0 tears down first; its rank 1 has not finished: rank 0 waits
    assert _leave(client, "g1/", 0, 1.0) >= 0.9  # it left at once: g0's count stood at 2
    assert _leave(client, "g2/", 1, 5.0, lost=(0,)) < 1.0  # g2's rank 1 saw rank 0 die ...
    assert _leave(client, "g3/", 1, 5.0, lost=(0,)) < 1.0  # ... as did g3's: counted for each
    assert client.add("g3/shutdown/done", 0) == 2
