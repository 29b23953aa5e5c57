"""Error texts that must not mislead (issue 30 item 15)."""
from commrt.runtime.errors import CollectiveMismatch


def test_a_mismatch_blamed_on_this_rank_itself_says_the_header_is_corrupt():
    """A garbage control page read back as rank 0's own made "rank 0 runs A, rank 0 runs B"."""
    e = CollectiveMismatch("all_reduce", 3, {"op": "all_reduce"}, {"op": "op 77"}, peer=0, rank=0)
    assert "rank 0 runs" in str(e) and str(e).count("rank 0 runs") == 1
    assert "a header attributed to rank 0 says" in str(e) and "corrupt" in str(e)
    e = CollectiveMismatch("all_reduce", 3, {"op": "all_reduce"}, {"op": "broadcast"}, peer=1, rank=0)
    assert "rank 0 runs" in str(e) and "rank 1 runs" in str(e)
