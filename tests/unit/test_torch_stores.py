"""Where the TCPStores of the programs that build their own torch world (``commrt bench train``'s
torch rows, workers.tdist_bench) listen: on MASTER_ADDR only, never on every interface, since
torch's store takes any connection without authentication. One rank, no gloo group: the
world's calls are stood in for and the store is read back from init_process_group."""
from __future__ import annotations

import datetime

import pytest
import torch.distributed as tdist

import commrt
from commrt.apps import tdist_bench
from commrt.bench import train_peers
from commrt.launch import free_port
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


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_second_init_on_torchruns_agent_store_is_a_new_rendezvous(restarts):
    """Under torchrun the agent's TCPStore outlives an init_process_group: a second init in the
    same process (restarts 0), or the next attempt after a restart (--max-restarts: the agent
    keeps its store, TORCHELASTIC_RESTART_COUNT counts up), found the first one's claims there,
    and every rank failed with "duplicate rank". Each open of the agent store is now a fresh
    namespace (attempt, then the process's count of opens, as every rank opens alike)."""
    from commrt.runtime import bootstrap, rendezvous
    from commrt.transport.transport import Transport
    port = free_port()
    agent = tdist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=10))  # noqa: F841
    transport = Transport(load_config(None, {"security": {"mode": "none"}}), "rank0")
    try:
        for attempt in range(2):
            env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "TORCHELASTIC_USE_AGENT_STORE": "true", "TORCHELASTIC_RESTART_COUNT": str(attempt * restarts)}
            spec = rendezvous.resolve("env://", None, None, env)
            store, server = bootstrap.open_store(transport, spec, 10)
            table = rendezvous.exchange(store, 0, 1, {"config": "d", "backend": "gloo"}, 5)
            assert [h["rank"] for h in table] == [0] and server is None
    finally:
        transport.close()
