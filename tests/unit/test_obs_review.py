"""Review of the observability layer (revB): each test failed before its fix."""
from commrt.obs import analyze


def _dump(rank, entries, world=3, gid=0, ranks=(0, 1, 2)):
    full = [{"kind": "coll", "peer": -1, "dtype": "float32", "state": "completed", "error": None, **e} for e in entries]
    return {"version": 1, "rank": rank, "world_size": world, "groups": [
        {"id": gid, "ranks": list(ranks), "rank": rank, "backend": "zmq",
         "last_seq": max((e["seq"] for e in entries), default=0), "last_p2p_seq": 0, "entries": full}]}


def test_a_rank_two_collectives_behind_is_blamed_for_the_one_it_missed():
    """Async ops let the others issue several collectives past a stuck rank: the finding named
    the newest one (here broadcast, seq 3) as the one rank 1 never entered at seq 2."""
    ops = [{"seq": 1, "op": "all_reduce", "nbytes": 40},
           {"seq": 2, "op": "all_gather_into_tensor", "nbytes": 96, "state": "started"},
           {"seq": 3, "op": "broadcast", "nbytes": 8, "state": "queued"}]
    findings, lines = analyze.analyze([_dump(0, ops), _dump(1, ops[:1]), _dump(2, ops)])
    assert [(f.kind, f.rank, f.seq, f.op) for f in findings] == [("behind", 1, 2, "all_gather_into_tensor")]
    assert "never entered seq 2 (all_gather_into_tensor)" in findings[0].detail, lines
