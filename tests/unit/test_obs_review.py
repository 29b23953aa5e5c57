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


def test_an_uneven_all_to_all_is_not_a_mismatch():
    """all_to_all_single with split sizes (MoE routing) sends a different number of bytes from
    each rank by design: the analysis blamed every rank of it as a mismatch (a tie), beside the
    rank that really was absent. A different op or dtype at that seq is still one."""
    def ops(nbytes, op="all_to_all_single", dtype="float32"):
        return [{"seq": 1, "op": op, "nbytes": nbytes, "dtype": dtype},
                {"seq": 2, "op": "all_reduce", "nbytes": 40, "state": "started"}]
    findings, lines = analyze.analyze([_dump(0, ops(48)), _dump(1, ops(64))], 3)
    assert [(f.kind, f.rank) for f in findings] == [("absent", 2)], lines
    findings, _ = analyze.analyze([_dump(0, ops(48)), _dump(1, ops(64)), _dump(2, ops(64, dtype="int8"))])
    assert [(f.kind, f.rank, f.op) for f in findings] == [("mismatch", 2, "all_to_all_single")]
    assert "float32" in findings[0].detail and "int8" in findings[0].detail
