"""``commrt launch --nnodes MIN:MAX``: this node's part of an elastic job (issue 33 item 1). The
protocol (generations, membership, the join deadline) is ``runtime/elastic.py``; the node's agent
``runtime/elastic_agent.py``; this module starts and stops the ranks of each generation with
the local launcher's mechanics (``commrt/launch.py``)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import deque
from typing import IO, Sequence

from commrt.launch import LaunchResult, _job_credentials, _reuse_freed_memory, free_port, rank_env
from commrt.runtime.config import load_config
from commrt.runtime.elastic import BEAT_S, EXIT_LOST, Coordinator, Policy
from commrt.runtime.elastic_agent import Beater, Outcome, run_node
from commrt.runtime.errors import RendezvousError
from commrt.runtime.processes import _start, _stop_everything, _stop_on_signals
from commrt.runtime.rendezvous import advertised_host, lookup
from commrt.runtime.store import StoreClient, StoreServer
from commrt.transport.security import check_bind
from commrt.transport.transport import Transport


def launch_elastic(nproc: int, cmd: Sequence[str], policy: Policy, node_rank: int, master_addr: str,
                   master_port: int, config: str | None = None, out: IO[str] | None = None,
                   timeout_s: float | None = None, env: dict | None = None, prefix: bool = True) -> LaunchResult:
    """This node's part of an elastic job: node 0 serves the rendezvous on ``master_addr:master_port``
    for the whole job; every node runs its ``nproc`` ranks in each generation that includes it.
    The result's ``failures`` lists every generation this node ran (members, why formed)."""
    if nproc < 1 or not 0 <= node_rank < policy.max_nodes:
        raise ValueError(f"nproc ({nproc}) must be >= 1 and node_rank ({node_rank}) in 0..{policy.max_nodes - 1}")
    out = out or sys.stdout
    base = dict(os.environ if env is None else env)
    _reuse_freed_memory(base)
    with _stop_on_signals(), _job_credentials(base, config, nproc, 0, all_nodes=False):
        return _elastic(nproc, cmd, policy, node_rank, master_addr, master_port, config, out, timeout_s, base, prefix)


def _elastic(nproc, cmd, policy, node_rank, master_addr, master_port, config, out, timeout_s, base,
             prefix) -> LaunchResult:
    cfg = load_config(config, environ=base)
    host = lookup(master_addr, "--master-addr")
    lock, tails, procs, pids, pumps = threading.Lock(), {}, [], [], []

    def say(line: str) -> None:
        with lock:
            out.write(f"[elastic node {node_rank}] {line}\n")
            out.flush()

    def start(plan: dict, index: int) -> list[subprocess.Popen]:
        members, (addr, port) = plan["members"], plan["master"]
        mine = []
        for r in range(nproc):
            g = index * nproc + r
            renv = rank_env(r, nproc, port, base, config, len(members), index, addr)
            gen = str(plan["gen"])
            renv.update(COMMRT_ELASTIC_GENERATION=gen, TORCHELASTIC_RESTART_COUNT=gen, COMMRT_RESTART_COUNT=gen,
                        COMMRT_ELASTIC_NODES=",".join(map(str, members)), COMMRT_NODE_ID=str(node_rank))
            tails[g] = tails.get(g) or deque(maxlen=200)
            p, t = _start(cmd, renv, f"rank {g}", out, lock, tails[g], prefix)
            mine.append(p)
            pids.append(p.pid)
            pumps.append(t)
        procs.extend(mine)
        return mine

    # under CURVE the launcher speaks with its node's first rank's key (keys_dir holds one per
    # rank of the largest world, so every node id has one); node 0 serves as rank 0 does
    transport = Transport(cfg, f"rank{node_rank * nproc}")
    server = clients = coordinator = beater = None
    try:
        if node_rank == 0:
            check_bind(cfg, [host])
            server = StoreServer(transport, host, master_port)
        say(f"joining the elastic job at {host}:{master_port} (nodes {policy.min_nodes}:{policy.max_nodes})")
        try:
            clients = [_elastic_client(transport, host, master_port, policy) for _ in range(3 if node_rank == 0 else 2)]
            if node_rank == 0:
                coordinator = Coordinator(clients[2], policy, say)
            me = advertised_host(cfg.cluster.bind_host, cfg.cluster.advertise_host, host)
            beater = Beater(clients[1], node_rank, me, lambda: free_port(me))
            outcome = run_node(clients[0], beater, policy, start, say, timeout_s)
        except RendezvousError as exc:  # node 0 never answered, or stopped for good
            outcome = Outcome(EXIT_LOST, f"lost the rendezvous: {exc}")
        say(f"ends with exit code {outcome.code}: {outcome.why}")
    finally:
        _stop_everything(procs)
        for part in (beater, coordinator):
            if part is not None:
                part.close()
        if server is not None:
            server.close(linger_s=2 * BEAT_S)  # the other nodes read "finished" or the abort
        for c in clients or ():
            c.close()
        transport.close()
    for t in pumps:
        t.join(2.0)
    lines = [f"generation {g}: nodes {m} ({why})" for g, m, why in outcome.generations]
    return LaunchResult(outcome.code, None, {r: list(t) for r, t in tails.items()}, pids, lines + [outcome.why])


def _elastic_client(transport, host: str, port: int, policy: Policy) -> StoreClient:
    """A client of node 0's store, waiting up to the join deadline for it to come up; its calls
    then give up after a few beats, so that a lost node 0 is noticed."""
    client = StoreClient(transport, host, port, policy.join_timeout_s)
    client.timeout_s = 4 * BEAT_S
    return client
