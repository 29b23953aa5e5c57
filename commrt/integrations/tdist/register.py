"""``torch.distributed`` backend "commrt": registration and the creator torch calls per group.

torch creates its own store first (env://, tcp://, file:// or the one passed in) and hands each
group's creator a copy prefixed with the group's name. The creator uses that store only for the
rendezvous exchange (keys under ``commrt/<n>/rdzv/``: socket addresses, wire version, config
digest, and a slow salted hash of the job secret so that a rank holding another secret is named
at once instead of its refused, silent handshakes running out the op timeout), then opens the group's sockets through commrt's ``Transport``, so the
data plane is authenticated exactly as under commrt's own API (job secret or CURVE, from
``COMMRT_*`` / the TOML config). torch's store itself stays torch's: unauthenticated TCP.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
import zlib

from commrt.runtime import rendezvous
from commrt.transport import security
from commrt.backends.zmq_backend import ZmqBackend
from commrt.runtime.config import Config, load_config
from commrt.runtime.errors import CommError
from commrt.runtime.store import TorchStore
from commrt.transport import Transport
from commrt.integrations.tdist.process_group import CommrtProcessGroup

log = logging.getLogger(__name__)

NAME = "commrt"
_lock = threading.Lock()
_shared: dict = {"transport": None, "config": None, "groups": 0}


def create(opts, _backend_options=None) -> CommrtProcessGroup:
    """torch's creator call for one group (``extended_api``: global ranks and the group name)."""
    members = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    return create_group(opts.store, opts.group_rank, opts.group_size, opts.timeout, members,
                        str(opts.group_id))


def create_group(store, rank: int, size: int, timeout: datetime.timedelta, members: list[int],
                 name: str, config: Config | None = None) -> CommrtProcessGroup:
    cfg, transport = _acquire(members[rank], config)
    cfg = _with_timeout(cfg, timeout)  # this group's deadlines: torch's timeout= where shorter
    try:
        group_id = zlib.crc32(name.encode()) & 0x7FFFFFFF  # the same on every member
        backend = ZmqBackend(transport, cfg, rank, size, group_id, members)
        try:
            _connect(backend, TorchStore(store, "commrt/"), cfg, rank, size)
        except BaseException:
            backend.close()
            raise
    except BaseException:
        _release()
        raise
    log.info("commrt group %r (%d ranks) ready", name, size)
    return CommrtProcessGroup(backend, rank, size, members, _release, name)


def _connect(backend: ZmqBackend, store: TorchStore, cfg: Config, rank: int, size: int) -> None:
    """Exchange addresses through torch's store, then prove the data plane with a barrier.
    Each (re)creation of a group with the same name on the same store is one incarnation."""
    incarnation = store.add(f"incarnation/{rank}", 1)
    hello = {"config": cfg.digest(), "backend": NAME, "addr": backend.addresses, "secret": secret_check(cfg)}
    table = rendezvous.exchange(store, rank, size, hello, cfg.comm.timeout_s, f"{incarnation}/")
    check_secrets(table, rank, store, f"{incarnation}/", cfg.comm.timeout_s)
    backend.connect([peer["addr"] for peer in table])
    backend.barrier()


def secret_check(cfg: Config) -> str:
    """A value equal on ranks with one job secret (``secret`` mode; "" otherwise). torch's store
    is readable by anyone who reaches it, so this is PBKDF2 (2**20 rounds, ~0.2 s once per
    process, security.derive): guessing a secret of 16+ characters from it is out of reach."""
    if cfg.security.mode != "secret":
        return ""
    return security.derive(security.job_secret(cfg), "tdist/secret-check")[:32]


def check_secrets(table: list[dict], rank: int, store, ns: str, timeout_s: float) -> None:
    """Every rank reads the same table: ranks whose secret differs from rank 0's are named on
    all of them (issue 30 item 10: a wrong secret was a PeerLost after the whole op timeout).
    Rank 0 (which serves torch's store at init) raises last: its leaving while another rank
    still talks to the store would turn that rank's verdict into "connection reset"."""
    differ = [r for r, peer in enumerate(table) if peer.get("secret") != table[0].get("secret")]
    if differ:
        if rank == 0:  # the others' last store call is the add below
            store.wait_count(ns + "secret-refused", len(table) - 1, None, min(timeout_s, 10.0))
        else:
            store.add(ns + "secret-refused", 1)
        raise CommError(f"rank {rank}: rank(s) {rendezvous.rank_ranges(differ)} hold another job secret than "
                        f"rank 0 (${security.SECRET_ENV} or [security] secret_file); their connections "
                        "would be refused")


def _acquire(global_rank: int, config: Config | None) -> tuple[Config, Transport]:
    """The process's config and Transport, made by its first commrt group, closed with its last."""
    with _lock:
        if _shared["transport"] is None:
            cfg = _effective(config or load_config(None))
            _shared["transport"], _shared["config"] = Transport(cfg, f"rank{global_rank}"), cfg
        _shared["groups"] += 1
        return _shared["config"], _shared["transport"]


def _release() -> None:
    with _lock:
        _shared["groups"] -= 1
        if _shared["groups"] == 0 and _shared["transport"] is not None:
            _shared["transport"].close()
            _shared["transport"] = _shared["config"] = None


def _effective(cfg: Config) -> Config:
    """Bind where the config says (loopback by default), advertise a dialable address."""
    cl, master = cfg.cluster, os.environ.get("MASTER_ADDR", "127.0.0.1")
    security.check_bind(cfg, [cl.bind_host])
    advertise = rendezvous.advertised_host(cl.bind_host, cl.advertise_host, rendezvous.lookup(master, "MASTER_ADDR"))
    return dataclasses.replace(cfg, cluster=dataclasses.replace(cl, advertise_host=advertise))


def _with_timeout(cfg: Config, timeout: datetime.timedelta | None) -> Config:
    """A group's deadlines: the shorter of commrt's ``[comm] timeout_s`` and torch's ``timeout=``
    (``init_process_group`` / ``new_group``), so each group keeps its own."""
    if timeout is None or not 0 < timeout.total_seconds() < cfg.comm.timeout_s:
        return cfg
    return dataclasses.replace(cfg, comm=dataclasses.replace(cfg.comm, timeout_s=timeout.total_seconds()))
