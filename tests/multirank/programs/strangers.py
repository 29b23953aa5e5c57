"""Strangers knock on rank 1's data socket just before a collective, each with a message forged to
look like rank 0's part of it; under the secret (default) and curve modes none may get in, and
the collective must still give the exact answer. Run at 3 ranks.

    strangers KIND   with KIND in plaintext | raw_tcp | silent_tcp (any mode),
                     unknown_key | other_rank (curve), wrong_secret (secret)
"""
from __future__ import annotations

import os
import socket
import sys
import time

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

import commrt
from commrt.collectives.context import Coll
from commrt.transport.wire import COLL, Header, encode_header

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
COUNT = 8
SETTLED = {zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
           zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_DISCONNECTED}
DEADLINE_S = 10.0  # under the ranks' 20 s comm timeout: a stuck stranger is named, not a silent rank 0


def forged(backend) -> list[bytes]:
    h = Header(COLL, 0, backend._seq + 1, 0, int(Coll.ALL_REDUCE), 1, COUNT, 0, COUNT * 4)
    return [encode_header(h), np.full(COUNT, 1e6, dtype=np.float32).tobytes()]


def knock(kind: str, backend) -> list:
    """Returns what must stay open until the collective is over."""
    ep = backend._coll
    addr = ep.peer_addresses[1]
    host, port = addr[len("tcp://"):].rsplit(":", 1)
    keys = os.environ.get("COMMRT_SECURITY_KEYS_DIR", "")
    allow = dict(line.split() for line in open(os.path.join(keys, "allow.txt"))) if keys else {}
    ctx = zmq.Context.instance()
    if kind in ("plaintext", "unknown_key", "other_rank", "wrong_secret"):
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == "wrong_secret":  # the right protocol and a name from the job, a guessed secret
            sock.plain_username, sock.plain_password = b"rank0", b"guessed-" + os.urandom(8).hex().encode()
        elif kind == "unknown_key":
            public, secret = zmq.curve_keypair()
            sock.curve_publickey, sock.curve_secretkey = public, secret
            sock.curve_serverkey = allow["rank1"].encode()
        elif kind == "other_rank":  # rank 2's genuine key, claiming to be rank 0
            public, secret = open(os.path.join(keys, "rank2.key")).read().split()
            sock.curve_publickey, sock.curve_secretkey = public.encode(), secret.encode()
            sock.curve_serverkey = allow["rank1"].encode()
        sock.setsockopt(zmq.SNDTIMEO, int(DEADLINE_S * 1000))
        sock.copy_threshold = 0  # frames zmq holds, not copies: the tracker says when they went out
        monitor = sock.get_monitor_socket(zmq.EVENT_ALL)
        sock.connect(addr)
        settled = _settled(monitor)
        if settled not in (None, zmq.EVENT_HANDSHAKE_SUCCEEDED):
            return [sock]  # refused at the handshake: libzmq dropped the pipe, nothing can be sent
        try:  # admitted (mode none), or still undecided at the deadline: send
            tracker = sock.send_multipart(forged(backend), copy=False, track=True)
        except zmq.Again:  # refused before the message was queued: a refusal that libzmq
            return [sock]  # answers by dropping the connection's pipe, so a send without a deadline blocks for ever
        if settled == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            _delivered(tracker)  # the forgery goes before rank 0's own next message
        return [sock]
    raw = socket.create_connection((host, int(port)), timeout=DEADLINE_S)
    if kind == "raw_tcp":
        raw.sendall(b"\xff" + os.urandom(64) + b"".join(forged(backend)))
        _closed_by_peer(raw)
    return [raw]  # silent_tcp: connected, never says a word


def _settled(monitor: zmq.Socket) -> int | None:
    """Wait (bounded) until rank 1 admitted or refused the stranger, instead of sleeping: what
    the stranger sent is then in, or out, before the job's own messages follow. Returns the event."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if monitor.poll(100) and (event := recv_monitor_message(monitor)["event"]) in SETTLED:
            return event
    # go on: the stranger must be refused whenever its handshake ends, and the results checked
    print(f"note: the stranger's handshake had not settled after {DEADLINE_S:g}s", file=sys.stderr, flush=True)
    return None


def _delivered(tracker: zmq.MessageTracker) -> None:
    """An admitted forgery is queued when the handshake succeeds, and written out a little later:
    wait until it has left (bounded), then give rank 1's I/O thread a moment to take it in, so that
    it reaches rank 1 before rank 0's genuine message for the same step does (a loaded run once saw
    the genuine one first, and the forgery never read)."""
    try:
        tracker.wait(DEADLINE_S)
    except zmq.NotDone:
        print(f"note: the admitted forgery had not gone out after {DEADLINE_S:g}s", file=sys.stderr, flush=True)
        return
    time.sleep(0.5)


def _closed_by_peer(raw: socket.socket) -> None:
    """Rank 1 drops a connection that speaks no ZMTP: wait for that (bounded)."""
    raw.settimeout(20)
    try:
        while raw.recv(4096):
            pass
    except (ConnectionResetError, socket.timeout):
        pass


def main() -> int:
    kind = sys.argv[1]
    commrt.init_process_group()
    backend = commrt.get_world_group().backend
    commrt.all_reduce(np.ones(COUNT, np.float32))
    held = []
    attacker = 2 if kind == "other_rank" else 0
    if RANK == attacker:
        held = knock(kind, backend)
    commrt.barrier()  # the stranger's fate was settled before its rank entered this barrier
    t = np.full(COUNT, float(RANK + 1), np.float32)
    commrt.all_reduce(t)
    ok = np.array_equal(t, np.full(COUNT, float(sum(range(1, WORLD + 1))), np.float32))
    for _ in range(3):  # and the job goes on
        u = np.arange(COUNT, dtype=np.float32)
        commrt.all_reduce(u)
        ok = ok and np.array_equal(u, np.arange(COUNT, dtype=np.float32) * WORLD)
    print(f"RESULT {'exact' if ok else 'WRONG'} dropped={backend._coll.dropped}", flush=True)
    for h in held:
        h.close()
    commrt.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
