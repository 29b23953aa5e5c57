"""Prometheus metrics of one server shard (``[ps] metrics_port``), through ``prometheus_client``.

The numbers are the ones ``commrt server-status`` prints: a custom collector reads
``ServerCore.stats()`` when Prometheus scrapes, so the request path pays nothing for them (the
apply-latency histogram is the one thing the core records itself, for both views). Each server
has its own ``CollectorRegistry``: nothing lands in the process-global default registry, so
two shards in one process (the tests) or a user's own metrics never collide.
"""
from __future__ import annotations

import io
import logging
import socket
import threading
import time
from typing import Callable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from commrt.runtime.errors import ConfigError
from commrt.ps.state import MAX_GAP

log = logging.getLogger(__name__)

COUNTERS = {  # stats() key -> (metric name without _total, help)
    "pushes": ("commrt_ps_pushes", "gradient pushes accepted (a re-sent push counts once)"),
    "pulls": ("commrt_ps_pulls", "parameter pulls accepted"),
    "bytes_in": ("commrt_ps_bytes_in", "request bytes received (headers and payloads)"),
    "bytes_out": ("commrt_ps_bytes_out", "parameter bytes sent in pull replies"),
    "rejected": ("commrt_ps_rejected", "requests refused with an error reply"),
    "duplicates": ("commrt_ps_duplicates", "re-sent pushes acknowledged without applying them again"),
    "malformed": ("commrt_ps_malformed", "requests dropped because their header did not decode"),
    "ssp_waits": ("commrt_ps_ssp_waits", "requests held by the SSP staleness bound"),
}
_SCRAPE_TRIES = 3


class ServerCollector(Collector):
    """The metrics of ``stats()`` (a ``ServerCore.stats``), read at scrape time."""

    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def _read(self) -> dict:
        # the server thread may add a key to a dict stats() iterates (a new staleness gap): a
        # RuntimeError then, never a torn number; reading again is cheaper than a lock on the
        # request path
        for _ in range(_SCRAPE_TRIES - 1):
            try:
                return self._stats()
            except RuntimeError:
                continue
        return self._stats()

    def collect(self) -> Iterator[Metric]:
        st = self._read()
        server = str(st["server"])
        for key, (name, doc) in COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=["server"])
            c.add_metric([server], st[key])
            yield c
        yield _gauge("commrt_ps_version", "updates applied (the shard's version)", server, st["version"])
        yield _gauge("commrt_ps_param_bytes", "bytes of parameters held", server, st["param_bytes"])
        yield _per_worker("commrt_ps_worker_clock", "steps of each worker applied here", server, st["clocks"])
        yield _per_worker("commrt_ps_worker_lag", "steps each worker is behind the fastest", server, st["lag"])
        parked = GaugeMetricFamily("commrt_ps_parked", "requests waiting, by kind", labels=["server", "kind"])
        for kind, n in st["parked"].items():
            parked.add_metric([server, kind], n)
        yield parked
        yield _gauge("commrt_ps_dropped_workers", "workers dropped after going silent", server, len(st["dropped"]))
        yield _gauge("commrt_ps_joined_workers", "workers whose init matched the seed", server, len(st["joined"]))
        yield _gauge("commrt_ps_segments", "key ranges (segments) held", server, st["segments"])
        gaps = CounterMetricFamily("commrt_ps_updates_by_staleness", "updates applied, by how many steps the "
                                   f"pushing worker was ahead of the slowest (gap {MAX_GAP}: that many or more)",
                                   labels=["server", "gap"])
        for gap, n in st["staleness"].items():
            gaps.add_metric([server, gap], n)
        yield gaps
        yield _histogram(st["apply_latency"], server)


def _gauge(name: str, doc: str, server: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["server"])
    g.add_metric([server], value)
    return g


def _per_worker(name: str, doc: str, server: str, values: list[int]) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["server", "worker"])
    for w, v in enumerate(values):
        g.add_metric([server, str(w)], v)
    return g


def _histogram(h: dict, server: str) -> HistogramMetricFamily:
    """Prometheus buckets are cumulative; the core keeps one count per bucket."""
    out = HistogramMetricFamily("commrt_ps_apply_seconds", "time to apply one update (optimizer step on "
                                "the segments)", labels=["server"])
    total, buckets = 0, []
    for bound, n in zip([*map(str, h["buckets"]), "+Inf"], h["counts"]):
        total += n
        buckets.append((bound, total))
    out.add_metric([server], buckets, h["sum"])
    return out


MAX_CONNECTIONS = 8  # connections served at once: one thread each; more are closed at accept
IDLE_S = 5.0  # a connection that sends no complete request in this long (in all) is dropped


class _Deadline(io.RawIOBase):
    """A connection's reads bounded in total, not per read: a client that sends a byte every few
    seconds never trips a per-read timeout, and eight of them held every slot for good."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no complete request within {IDLE_S:g}s")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _Writer(io.RawIOBase):
    """The reply, each write bounded by IDLE_S (sendall's timeout covers the whole call); the
    reads may have left the socket a nearly spent timeout."""

    def __init__(self, sock: socket.socket):
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self._sock.settimeout(IDLE_S)
        self._sock.sendall(data)
        return len(data)


class _Quiet(WSGIRequestHandler):
    def setup(self):
        super().setup()
        self.rfile = io.BufferedReader(_Deadline(self.connection, time.monotonic() + IDLE_S))
        self.wfile = _Writer(self.connection)

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        """Scrapes are not worth a log line each."""


class _BoundedServer(WSGIServer):
    """prometheus_client's server starts a thread per connection with no cap (300 idle
    connections held 310 threads, issue 30 item 14): here at most MAX_CONNECTIONS threads, each
    connection dropped after IDLE_S without a request, the rest refused at accept."""
    request_queue_size = 128  # listen backlog (socketserver's 5 left a burst of connects in SYN retries)

    def __init__(self, *args, **kwargs):
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.refused = 0
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        request.settimeout(IDLE_S)
        threading.Thread(target=self._serve, args=(request, client_address), daemon=True,
                         name="commrt-ps-metrics-conn").start()

    def _serve(self, request, client_address):
        try:
            self.finish_request(request, client_address)
        except Exception as exc:  # noqa: BLE001 - a client that hung up or stayed silent
            log.debug("metrics connection from %s ended: %r", client_address, exc)
        finally:
            self.shutdown_request(request)
            self._slots.release()


def _serve_http(registry, addr: str, port: int) -> tuple[WSGIServer, threading.Thread]:
    family, host = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0::4]
    server_class = type("_Server", (_BoundedServer,), {"address_family": family})
    httpd = make_server(host[0], port, make_wsgi_app(registry), server_class, handler_class=_Quiet)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True, name="commrt-ps-metrics")
    thread.start()
    return httpd, thread


class MetricsServer:
    """The HTTP endpoint: ``/metrics`` from a private registry, on its own daemon thread."""

    def __init__(self, stats: Callable[[], dict], addr: str, port: int):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ServerCollector(stats))
        try:
            self._httpd, self._thread = _serve_http(self.registry, addr, port)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {addr}:{port}: {exc}") from None
        self.port = self._httpd.server_address[1]
        log.info("metrics on http://%s:%d/metrics", addr, self.port)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
