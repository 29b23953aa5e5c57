"""Setting up the world group for each backend (its sub-groups: runtime/groups.py).

The zmq world: rank 0 serves the bootstrap store, every rank opens its sockets, publishes its
addresses in a hello (with protocol version and config digest), learns the others' (those of its
node at init, the rest when it first dials them: rendezvous.meet), and a barrier proves the data
plane works before init returns. gloo/nccl: every rank reads every hello to validate the job, then a torch TCPStore (its port handed out through our store) bootstraps
torch.distributed, so one init serves both.

torch, its store and the gloo/nccl adapter are imported where a gloo/nccl world (or torchrun's
agent store) needs them: a zmq rank that moves numpy buffers never loads torch (issue 32.2).
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import logging
import os
import sys

from commrt.runtime import devices, rendezvous
from commrt.transport import security
from commrt.topology import nodes as topology
from commrt.backends.zmq_backend import ZmqBackend
from commrt.runtime.config import Config
from commrt.runtime.errors import CommError, ConfigError
from commrt.runtime.group import ProcessGroup
from commrt.runtime.groups import Tally, is_torch_backend as _is_torch_backend, store_rank
from commrt.runtime.groups import new_group  # noqa: F401 (callers reach it as bootstrap.new_group)
from commrt.runtime.store import StoreServer, TorchStore, wait_for
from commrt.runtime.store_proxy import StoreProxy, connect, use_proxy
from commrt.runtime.store_core import OK
from commrt.transport import Transport

log = logging.getLogger(__name__)

LEAVING_CALL_S = 2.0  # a shutdown handshake's store call: rank 0 may be gone already (a failed job)
# what a GPU's driver shows (NVIDIA's, before its device files exist too; AMD's ROCm; WSL):
# without any, torch.cuda cannot find a device either, so "auto" picks zmq without importing torch
GPU_DEVICES = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


@dataclasses.dataclass
class Runtime:
    """Everything init_process_group created, so destroy_process_group can undo it."""
    config: Config
    world: ProcessGroup
    transport: Transport
    """This runtime's zmq context, Guard and socket factory (one owner of them all)."""
    store: object
    store_server: StoreServer | None
    owns_store: bool = True
    groups: list = dataclasses.field(default_factory=list)
    next_group_id: int = 1
    topology: topology.Topology | None = None
    """Which rank is on which node (from the hellos)."""
    extras: dict = dataclasses.field(default_factory=dict)
    """State of upper layers tied to this runtime (e.g. the hierarchical collectives' groups)."""
    hellos: rendezvous.Hellos | None = None
    """The zmq world's peers' hellos, read when first needed (None: gloo/nccl read them all)."""
    namespace: str = ""
    """Prefix of this runtime's keys in the bootstrap store (several may share one)."""
    store_groups: int = 0
    """zmq groups of more than one rank: their members use the store after new_group returned on
    a non-member (see shutdown)."""
    group_reads: Tally = dataclasses.field(default_factory=Tally)
    """Group addresses this rank read from the store (comm_stats()["rendezvous"])."""
    store_proxy: StoreProxy | None = None
    """The store proxy this rank serves for its node (a node's local rank 0; store_proxy.py)."""


def choose_backend(requested: str, local_world_size: int) -> tuple[str, str]:
    """(backend, why). ``auto`` takes NCCL only if every local rank can have its own GPU."""
    if requested != "auto":
        return requested, "requested in config"
    if "torch" not in sys.modules and not any(os.path.exists(d) for d in GPU_DEVICES):
        return "zmq", "CUDA is not available (no GPU driver or device)"
    import torch  # lazy: only a host with a GPU asks torch about it
    if not torch.cuda.is_available():
        return "zmq", "CUDA is not available"
    if not torch.distributed.is_nccl_available():
        return "zmq", "this torch build has no NCCL"
    gpus = torch.cuda.device_count()
    if gpus < local_world_size:
        return "zmq", f"{local_world_size} local ranks but only {gpus} GPUs"
    return "nccl", f"CUDA with {gpus} GPUs for {local_world_size} local ranks"


def open_store(transport: Transport, spec: rendezvous.RendezvousSpec, timeout_s: float):
    """(client, server-or-None): rank 0 serves the store unless torchrun's agent does."""
    client, _, server = open_node_store(transport, spec, timeout_s, None)
    return client, server


_agent_opens = itertools.count()  # torchrun's agent store opened by this process so far


def open_node_store(transport: Transport, spec: rendezvous.RendezvousSpec, timeout_s: float,
                    node: list[int] | None):
    """(client, proxy-or-None, server-or-None). ``node``: this rank's node hint ([node, local
    rank, local ranks]) when its world reaches the store through a proxy per node (issue 32.5):
    a node other than rank 0's talks to the proxy its local rank 0 serves (that rank too)."""
    if spec.use_agent_store:  # torchrun's agent already serves a TCPStore on MASTER_PORT
        import torch.distributed  # lazy: torchrun's world runs torch anyway
        tstore = torch.distributed.TCPStore(spec.host, spec.port, None, False,
                                            timeout=datetime.timedelta(seconds=timeout_s))
        # the agent's store outlives this rendezvous: a later init, or the next attempt after a
        # restart, found its claims ("duplicate rank"). Every rank opens it alike, so the count
        # of opens in this process (after torch's attempt prefix) names a fresh namespace.
        return TorchStore(tstore, f"commrt/attempt_{spec.attempt}/{next(_agent_opens)}/"), None, None
    server = StoreServer(transport, spec.host, spec.port) if spec.rank == 0 else None
    try:
        return (*connect(transport, spec.host, spec.port, spec.rank, timeout_s, node), server)
    except BaseException:
        if server is not None:
            server.close()
        raise


def _effective(cfg: Config, spec: rendezvous.RendezvousSpec) -> Config:
    """``cfg`` with the address peers should dial filled in (see rendezvous.advertised_host),
    after checking that the hosts we bind to resolve and may be exposed."""
    cl = cfg.cluster
    security.check_bind(cfg, [cl.bind_host] + ([spec.host] if spec.rank == 0 else []),
                        dialled=[] if spec.rank == 0 else [spec.host])
    advertise = rendezvous.advertised_host(cl.bind_host, cl.advertise_host, spec.host)
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cl, advertise_host=advertise))


def init_world(cfg: Config, spec: rendezvous.RendezvousSpec, environ=os.environ,
               store: tuple | None = None, namespace: str = "") -> Runtime:
    """Create the world group. ``store``/``namespace`` let several runtimes (e.g. the benchmark's
    backends side by side) share one bootstrap store."""
    local = _env_int(environ, "LOCAL_WORLD_SIZE", spec.world_size)
    name, why = choose_backend(cfg.comm.backend, local)
    log.info("backend %s (%s)", name, why)
    timeout = cfg.comm.timeout_s
    cfg = _effective(cfg, spec)
    transport = Transport(cfg, f"rank{spec.rank}")
    owns_store, proxy, leader = store is None, None, None
    hint = topology.node_hint(environ)
    try:
        if owns_store:
            node = hint if use_proxy(cfg.cluster.store_proxy, name, hint, spec.world_size,
                                     spec.use_agent_store) else None
            store, proxy, server = open_node_store(transport, spec, timeout, node)
            leader = spec.rank - node[1] if getattr(store, "via", "") else None  # None: direct
        else:
            store, server = store
    except BaseException:
        transport.close()
        raise
    backend = None  # closed on failure: a zmq one holds an ~8 MiB shared-memory segment
    try:
        hello = {"config": cfg.digest(), "backend": name, "node": hint,
                 "where": cfg.cluster.advertise_host}
        if name == "zmq":
            backend = ZmqBackend(transport, cfg, spec.rank, spec.world_size, 0)
            met = rendezvous.meet(store, spec.rank, spec.world_size, {**hello, "addr": backend.addresses},
                                  timeout, namespace,
                                  lambda table: ZmqBackend.needs_every_address([p["addr"] for p in table]))
            hellos = rendezvous.Hellos(store, spec.rank, spec.world_size, namespace, timeout, met,
                                       None if spec.use_agent_store else 0, proxy_rank=leader)
            layout = _connect_zmq(backend, met, hellos, spec.rank)
            backend.barrier()
        elif name == "nccl":
            gpu = devices.describe(_env_int(environ, "LOCAL_RANK", spec.rank))
            table = rendezvous.exchange(store, spec.rank, spec.world_size, {**hello, "gpu": gpu}, timeout, namespace)
            layout = topology.from_hellos(table)
            why = devices.problems([peer["gpu"] for peer in table], layout)
            backend = (_refuse_or_fall_back(cfg, spec, "; ".join(why), store, timeout, namespace, transport)
                       if why else _init_nccl(cfg, store, spec, timeout, namespace, transport))
        elif name == "gloo":
            layout = topology.from_hellos(rendezvous.exchange(store, spec.rank, spec.world_size, hello,
                                                              timeout, namespace))
            backend = _init_torch(name, store, spec, timeout, namespace, cfg)
        else:
            raise ConfigError(f"unknown backend '{name}'; valid: ['auto', 'zmq', 'gloo', 'nccl']")
    except BaseException:
        if backend is not None:
            backend.close()
        if owns_store:
            rendezvous.abort_told(store, spec.world_size, namespace, server is not None or proxy is not None)
            if server is not None:
                server.close(linger_s=1.0)
            store.close()
            if proxy is not None:
                proxy.close(linger_s=1.0)
        transport.close()
        raise
    world = ProcessGroup(tuple(range(spec.world_size)), spec.rank, backend, 0)
    transport.counters.same_node = [layout.same_node(spec.rank, r) for r in range(spec.world_size)]
    return Runtime(cfg, world, transport, store, server, owns_store, topology=layout,
                   hellos=hellos if name == "zmq" else None, namespace=namespace, store_proxy=proxy)


def _env_int(environ, name: str, default: int) -> int:
    """A launcher's count (LOCAL_WORLD_SIZE, LOCAL_RANK) or ``default``; a ConfigError naming the
    variable when it is not a non-negative integer (int() raised a bare ValueError here)."""
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{name}={raw!r} is invalid; expected an integer >= 0 (set by the launcher)")
    return value


def _likely_partners(rank: int, n: int) -> set[int]:
    """The peers the world barrier (dissemination: rank +- 2^k) and recursive doubling (rank xor
    2^k) talk to: O(log n), read with this node's in one request rather than one per first dial
    (init's barrier dials them one after another)."""
    out, step = set(), 1
    while step < n:
        out |= {(rank + step) % n, (rank - step) % n} | ({rank ^ step} if rank ^ step < n else set())
        step *= 2
    return out


def _connect_zmq(backend: ZmqBackend, met: rendezvous.Met, hellos: rendezvous.Hellos,
                 rank: int) -> topology.Topology:
    """The world's layout, and its backend connected: with every hello (no node hints, or a
    shared-memory world), or with this node's ranks' hellos read now (one request) and every
    other peer's when it is first dialled (issue 32.5)."""
    if met.nodes is None:
        layout = topology.from_hellos(met.table)  # rank 0 checked it too: a bad one failed everywhere
        backend.connect([peer["addr"] for peer in met.table])
        return layout
    layout = topology.from_sizes(met.nodes)
    first = sorted(set(layout.ranks_on(layout.node_rank(rank))) | _likely_partners(rank, layout.world_size))
    hellos.get([r for r in first if r != rank], "init (this node's ranks and the barrier's partners)")
    backend.connect_lazy(lambda peers, op, lost: {p: h["addr"] for p, h in hellos.get(peers, op, lost).items()})
    return layout


def _init_nccl(cfg: Config, store, spec: rendezvous.RendezvousSpec, timeout_s: float, namespace: str,
               transport: Transport):
    """NCCL through torch, bootstrapped by our store. Every rank reports how its attempt went;
    if any failed, ``auto`` falls back to zmq on every rank (with a warning naming the cause),
    an explicit ``nccl`` is an error naming the ranks and causes."""
    import torch
    from commrt.runtime import torch_init  # lazy, as torch: a zmq world never needs them
    tstore = None  # held until every rank has reported: others may still be connecting to it
    try:
        tstore = torch_init.torch_store(store, spec, timeout_s, namespace)
        backend, outcome = _init_torch("nccl", store, spec, timeout_s, namespace, cfg, tstore=tstore), b""
    except Exception as exc:  # NCCL missing, driver trouble: all become the cause
        backend, outcome = None, f"{type(exc).__name__}: {exc}".encode()[:1000]
    store.set(f"{namespace}nccl/{spec.rank}", outcome or b"ok")
    keys = [f"{namespace}nccl/{r}" for r in range(spec.world_size)]
    results = wait_for(store, keys, timeout_s, "NCCL initialisation")
    del tstore
    failed = {r: v.decode(errors="replace") for r, v in enumerate(results) if v != b"ok"}
    if not failed:
        return backend
    if backend is not None:
        torch.distributed.destroy_process_group()
    causes = "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items()))
    return _refuse_or_fall_back(cfg, spec, causes, store, timeout_s, namespace, transport, "initialisation failed")


def _refuse_or_fall_back(cfg: Config, spec: rendezvous.RendezvousSpec, causes: str, store, timeout_s: float,
                         namespace: str, transport: Transport, what: str = "cannot run"):
    """An explicit ``nccl`` fails with the causes on every rank (each has read the same table;
    rank 0, which serves the store, waits briefly until all have, so none sees a closed store
    instead); ``auto`` falls back to zmq on every rank."""
    if cfg.comm.backend == "nccl":
        store.add(f"{namespace}nccl/refused", 1)
        if spec.rank == 0:
            store.wait_count(f"{namespace}nccl/refused", spec.world_size, None, min(timeout_s, 10.0))
        raise CommError(f"rank {spec.rank}: backend 'nccl' was requested but NCCL {what} ({causes})")
    log.warning("NCCL %s (%s); falling back to zmq", what, causes)
    zcfg = dataclasses.replace(cfg, comm=dataclasses.replace(cfg.comm, backend="zmq"))
    fallback = ZmqBackend(transport, zcfg, spec.rank, spec.world_size, 0)
    try:
        table = rendezvous.exchange(store, spec.rank, spec.world_size, {"config": cfg.digest(), "backend": "zmq",
                                    "addr": fallback.addresses}, timeout_s, namespace + "fallback/")
        fallback.connect([peer["addr"] for peer in table])
        fallback.barrier()
    except BaseException:  # init_world never sees it: close its shared-memory segment here
        fallback.close()
        raise
    return fallback


def _init_torch(name: str, store, spec: rendezvous.RendezvousSpec, timeout_s: float,
                namespace: str, cfg: Config, tstore=None):
    import torch
    from commrt.runtime import torch_init  # lazy, as torch: a zmq world never needs them
    from commrt.integrations.torch_backend import TorchBackend
    td = datetime.timedelta(seconds=timeout_s)
    tstore = tstore or torch_init.torch_store(store, spec, timeout_s, namespace)
    if name == "nccl":  # devices.problems has made sure there is one GPU for each rank
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", spec.rank)) % torch.cuda.device_count())
    with torch_init.gloo_interface(cfg):
        torch.distributed.init_process_group(torch_init.torch_backend_string(name, cfg.comm.backend),
                                             store=torch.distributed.PrefixStore("commrt", tstore),
                                             rank=spec.rank, world_size=spec.world_size, timeout=td)
    return TorchBackend(name, torch.distributed.group.WORLD, list(range(spec.world_size)), spec.rank)


def _leave_together(rt: Runtime, within_s: float = 10.0) -> None:
    """Rank 0 hosts the stores torch's process group talks to: if it exits while another rank is
    still tearing its group down, that rank can die in C++ (std::terminate). So rank 0 waits,
    briefly, until every rank has finished its teardown. The keys carry the runtime's namespace:
    runtimes sharing one store (replica groups, the benchmark's backends) each count their own."""
    done = rt.namespace + "shutdown/done"
    try:
        rt.store.add(done, 1, timeout_s=LEAVING_CALL_S)
        # a rank this one saw die never counts itself: the first rank to report it counts it
        # (rank 0 waited out ``within_s`` after every pipeline over gloo that lost a stage)
        for peer in sorted(set().union(*(getattr(g.backend, "lost", ()) for g in rt.groups + [rt.world]))):
            if rt.store.add(f"{rt.namespace}shutdown/lost/{peer}", 1, timeout_s=LEAVING_CALL_S) == 1:
                rt.store.add(done, 1, timeout_s=LEAVING_CALL_S)
        if rt.world.rank != 0:
            return
        if rt.store.wait_count(done, rt.world.size(), None, within_s)[0] != OK:
            log.warning("rank 0: not every rank finished its teardown within %gs", within_s)
    except CommError as exc:  # a peer already gone: nothing left to wait for
        log.warning("shutdown handshake skipped: %s", exc)


def _keep_store_for_readers(rt: Runtime, within_s: float = 10.0) -> None:
    """A zmq world reads a peer's hello from rank 0's store when it first dials that peer, and a
    group's members publish and read their addresses there while rank 0, a non-member, may have
    moved on (runtime/groups.py), so rank 0 keeps serving it until every rank has reached its
    shutdown (at most ``within_s``): a rank still in its last op may dial a peer rank 0 never
    talked to; so does each node's store proxy (its leader waits as rank 0 does). A broken world
    skips it (a lost rank never comes; one lost to rank 0's death would wait on a dead store)."""
    if rt.world.backend.broken is not None:
        return
    try:
        left = rt.namespace + "rdzv/left"
        rt.store.add(left, 1, timeout_s=LEAVING_CALL_S)
        serves = rt.world.rank == 0 or rt.store_proxy is not None
        if serves and rt.store.wait_count(left, rt.world.size(), None, within_s)[0] != OK:
            log.warning("rank %d: not every rank reached its shutdown within %gs; closing the store%s",
                        rt.world.rank, within_s, " proxy" if rt.world.rank else "")
    except CommError as exc:
        log.warning("store handshake at shutdown skipped: %s", exc)


def shutdown(rt: Runtime, keep_store: bool = False) -> None:
    lazy_world = rt.hellos is not None and rt.hellos.lazy
    if rt.owns_store and store_rank(rt) == 0 and (lazy_world or rt.store_groups):
        _keep_store_for_readers(rt)
    stopped = [g.backend.close() is not False for g in rt.groups + [rt.world]]
    for extra in rt.extras.values():  # after the groups: their close cancels what runs on them
        extra.close()
    if _is_torch_backend(rt.world.backend) and sys.modules["torch"].distributed.is_initialized():
        sys.modules["torch"].distributed.destroy_process_group()
        _leave_together(rt)
    if rt.owns_store and not keep_store:
        rt.store.close()
        if rt.store_proxy is not None:
            rt.store_proxy.close()
        if rt.store_server is not None:
            rt.store_server.close()
    rt.transport.close(leaked_sockets=not all(stopped))
