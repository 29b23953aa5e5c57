"""Where the TCPStores of the programs that build their own torch world (``commrt bench train``'s
torch rows, workers.tdist_bench) listen: on MASTER_ADDR only, never on every interface, since
torch's store takes any connection without authentication. One rank, no gloo group: the
world's calls are stood in for and the store is read back from init_process_group."""
from __future__ import annotations

import pytest
import torch.distributed as tdist

import commrt
from commrt.apps import tdist_bench
from commrt.bench import train_peers
from commrt.runtime.config import load_config
from tests.multirank.programs.multihost import listening


@pytest.fixture()
def one_rank(monkeypatch):
    """A world of one as the programs see it; yields where each store was listening."""
    seen = []
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setattr(commrt, "get_rank", lambda group=None: 0, raising=False)
    monkeypatch.setattr(commrt, "get_world_size", lambda group=None: 1, raising=False)
    monkeypatch.setattr(commrt, "get_config", lambda: load_config(environ={}), raising=False)
    monkeypatch.setattr(commrt, "broadcast", lambda tensor, src, group=None: None, raising=False)
    monkeypatch.setattr(tdist, "new_group", lambda *a, **k: None)

    def init(backend, store, **kwargs):
        seen.append([a for a in listening() if a.endswith(f":{store.port}")])
    monkeypatch.setattr(tdist, "init_process_group", init)
    return seen


def test_bench_train_store_listens_on_master_addr_only(one_rank):
    train_peers.TorchGroups()
    assert len(one_rank) == 1 and len(one_rank[0]) == 1 and one_rank[0][0].startswith("127.0.0.1:")


def test_tdist_bench_store_listens_on_master_addr_only(one_rank):
    tdist_bench.gloo_world(0, 1)
    assert len(one_rank) == 1 and len(one_rank[0]) == 1 and one_rank[0][0].startswith("127.0.0.1:")
