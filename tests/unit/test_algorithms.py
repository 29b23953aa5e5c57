"""The schedules, checked by simulating the data movement symbolically for many world sizes."""
import pytest

from commrt.collectives import algorithms as alg


@pytest.mark.parametrize("numel", [0, 1, 2, 7, 100, 1001])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7, 16])
def test_chunk_bounds_cover_and_balance(numel, parts):
    b = alg.chunk_bounds(numel, parts)
    assert len(b) == parts and b[0][0] == 0 and b[-1][1] == numel
    assert all(b[i][1] == b[i + 1][0] for i in range(parts - 1))
    sizes = [e - s for s, e in b]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 0


def test_chunk_bounds_rejects_nonsense():
    with pytest.raises(ValueError):
        alg.chunk_bounds(5, 0)


@pytest.mark.parametrize("start,end,step", [(0, 10, 3), (5, 5, 4), (3, 4, 100), (0, 12, 4)])
def test_pieces(start, end, step):
    p = alg.pieces(start, end, step)
    covered = [i for s, e in p for i in range(s, e)]
    assert covered == list(range(start, end)) and all(e - s <= step for s, e in p)


@pytest.mark.parametrize("n", range(1, 9))
def test_ring_reduce_scatter_then_all_gather(n):
    # have[r][c] = set of ranks whose contribution rank r holds for chunk c
    have = [[{r} for _ in range(n)] for r in range(n)]
    steps = [alg.ring_reduce_scatter_steps(r, n) for r in range(n)]
    for k in range(n - 1):
        sent = {r: set(have[r][steps[r][k][0]]) for r in range(n)}
        for r in range(n):
            left = (r - 1) % n
            chunk = steps[r][k][1]
            assert steps[left][k][0] == chunk  # left sends exactly what r expects
            have[r][chunk] |= sent[left]
    for r in range(n):
        assert have[r][r] == set(range(n)), f"rank {r} does not own a full chunk {r}"
    # all-gather: rank r starts owning chunk r
    full = [{r} for r in range(n)]
    owned = [set(full[r]) for r in range(n)]
    ag = [alg.ring_all_gather_steps(r, n) for r in range(n)]
    for k in range(n - 1):
        new = []
        for r in range(n):
            left = (r - 1) % n
            assert ag[left][k][0] == ag[r][k][1]
            assert ag[left][k][0] in owned[left]
            new.append(ag[r][k][1])
        for r in range(n):
            owned[r].add(new[r])
    assert all(o == set(range(n)) for o in owned)


@pytest.mark.parametrize("n", range(2, 9))
def test_pipeline_invariant_recv_chunk_is_next_send_chunk(n):
    for r in range(n):
        steps = alg.ring_reduce_scatter_steps(r, n) + alg.ring_all_gather_steps(r, n)
        assert all(steps[k][1] == steps[k + 1][0] for k in range(len(steps) - 1))


@pytest.mark.parametrize("n", range(1, 9))
def test_pairwise_exchange_meets_every_pair_once(n):
    pairs = [(r, dst) for r in range(n) for dst, _ in alg.pairwise_exchange_steps(r, n)]
    assert sorted(pairs) == sorted((a, b) for a in range(n) for b in range(n) if a != b)
    for r in range(n):
        for k, (dst, src) in enumerate(alg.pairwise_exchange_steps(r, n)):
            assert alg.pairwise_exchange_steps(dst, n)[k][1] == r  # the receiver expects us then


@pytest.mark.parametrize("n", range(1, 13))
def test_dissemination_barrier_reaches_everyone(n):
    knows = [{r} for r in range(n)]
    for k in range(len(alg.dissemination_steps(0, n))):
        snapshot = [set(s) for s in knows]
        for r in range(n):
            dst, src = alg.dissemination_steps(r, n)[k]
            assert alg.dissemination_steps(src, n)[k][0] == r
            knows[r] |= snapshot[src]
    assert all(s == set(range(n)) for s in knows)


@pytest.mark.parametrize("n", range(1, 6))
def test_chain_order(n):
    for src in range(n):
        chain = alg.chain_order(src, n)
        assert chain[0] == src and sorted(chain) == list(range(n))
