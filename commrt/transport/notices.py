"""The notices an Endpoint sends and reads beside the data: ABORT headers. A rank that gives up
tells its peers why (a lost rank, or a mismatch report), so ranks waiting elsewhere fail at once
with the same cause; a rank that closes a group on purpose says goodbye, so its dropped
connection is not blamed for what another rank waits on. A rank that refuses an op on its own
input sends REFUSE (``tell_refused``), and a peer that had started the op passes it on. Functions over an ``Endpoint`` (its
sockets, liveness and counters), kept apart from its send and receive paths."""
from __future__ import annotations

import logging

import zmq

from commrt.runtime.errors import CommError, OpRefused, PeerLost, ProtocolError
from commrt.transport.messages import Message, MismatchReport, decode_report
from commrt.transport.wire import ABORT, MAX_REASON_BYTES, REFUSE, Coll, Header, encode_header

log = logging.getLogger(__name__)

# A socket dialled at close only to say goodbye gets this long: a live peer's handshake takes
# milliseconds, and one that has gone meanwhile must not hold the process's exit for a second.
# On a crowded host the handshake can take longer (the peer's authenticator is a Python thread):
# that goodbye is then lost, and the rank that left may still be named (a CI run at 5 ranks on
# 2 cores named it once); over a connection the op already used, the goodbye gets the close linger.
GOODBYE_LINGER_MS = 200


def is_goodbye(h: Header) -> bool:
    """An ABORT naming its own sender as lost: "I closed this group on purpose" (``close``),
    so a peer whose connection then drops is not blamed for what a rank waits on elsewhere (a
    rank that got its broadcast from the root and left, while another still waits on a frozen
    rank, was named as the one lost)."""
    return h.kind == ABORT and h.nbytes == 0 and h.op == h.src


def aborted(ep, msg: Message, op: str, seq: int) -> None:
    """A peer gave up: on a lost rank (empty payload) or on a mismatch it saw (a report).
    Or it said goodbye (``is_goodbye``): noted, so its dropped connection blames no one. A
    report of a mismatch at a later op than ``seq`` is kept for when this rank starts that op
    (``Endpoint.refusal_at``): its peers finished this one (a rank slow in a barrier that its
    peers had left got their report of the next op and failed the barrier, seen under load)."""
    h = msg.header
    if is_goodbye(h):
        ep.live.left(h.src)
        return
    if h.nbytes == 0:  # so do we, naming the same rank
        raise PeerLost(h.op, op, seq, f"rank {h.src} reported it lost", reported_by=h.src)
    try:
        mine, theirs = decode_report(msg.payload.buffer)
    except ProtocolError as exc:
        ep.dropped += 1
        log.warning("rank %d dropped a malformed mismatch report from rank %d: %s", ep.rank, h.src, exc)
        return
    report = MismatchReport(h.src, mine, theirs)
    if mine.seq > seq:  # peers that finished this op met at a later one: fail there, as they did
        ep.refusals.setdefault(mine.seq, report)
        ep.keep_refusals_bounded()
        return
    raise report


def refused(ep, msg: Message, op: str, seq: int) -> None:
    """A REFUSE while this rank runs operation ``seq``: rank ``origin`` refused op ``h.seq``,
    said by itself or passed on by a peer that had started the op and gave up. This op fails
    on it; so does any op once a peer gave up (the group is unusable). The refusing rank's own
    word on an op this rank refused too, or finished without it, is no news; one on a later op
    is kept for when this rank starts it (``Endpoint.refusal_at``)."""
    h = msg.header
    origin = h.count
    if origin >= len(ep.names) or origin == ep.rank and h.src == origin:
        ep.dropped += 1
        log.warning("rank %d dropped a REFUSE naming rank %d from rank %d", ep.rank, origin, h.src)
        return
    reason = bytes(msg.payload.buffer).decode("utf-8", errors="replace")
    name = Coll(h.op).name.lower()
    if h.seq == seq and h.seq not in ep.refused_here:  # this op: whoever said it first
        raise OpRefused(origin, name, h.seq, reason)
    if h.seq > seq:
        ep.refusals.setdefault(h.seq, OpRefused(origin, name, h.seq, reason))
        ep.keep_refusals_bounded()
    elif h.src != origin:
        raise OpRefused(origin, name, h.seq, reason, reported_by=h.src)


def tell_refused(ep, seq: int, coll: int, origin: int, reason: str) -> None:
    """Best effort, never blocking: tell the peers that rank ``origin`` refused collective
    ``coll`` at ``seq``. This rank's own refusal goes to every peer; one passed on (it made this
    rank give up) to the refusing rank and the peers this rank is connected to, as relayed
    ABORTs are (issue 32.5: relayed to every peer by every rank, they dialled n^2 connections)."""
    payload = reason.encode("utf-8", errors="replace")[:MAX_REASON_BYTES]
    h = encode_header(Header(REFUSE, ep.group, seq, ep.rank, coll, 0, origin, 0, len(payload)))
    if origin != ep.rank:
        peers = [origin, *(p for p in ep._out if p != origin)]
    else:
        try:
            peers = ep.all_peers("a refusal notice")
        except CommError as exc:  # the addresses not known yet are unreadable: tell those we know
            log.warning("rank %d: refusal notice to known peers only: %s", ep.rank, exc)
            peers = list(ep.peer_addresses)
    for peer in peers:
        if peer == ep.rank:
            continue
        try:
            ep.socket_to(peer).send_multipart([h, payload], zmq.NOBLOCK)
        except (zmq.ZMQError, ValueError, CommError):
            pass


def tell_peers(ep, seq: int, lost: int | None = None, report: bytes = b"",
               connected_only: bool = False) -> None:
    """Best effort, never blocking: tell every other peer that we give up, naming the rank
    we lost (``lost``) or carrying a mismatch ``report``, so ranks waiting elsewhere fail
    at once with the same cause instead of timing out on us when we leave.
    ``connected_only``: only the peers we already have a connection to (a notice passed on:
    relayed to every peer by every rank, it dialled n^2 connections; issue 32.5).
    The peers without a connection are dialled (no liveness monitor: the group is unusable from
    now on) before any notice goes out, and no more once another rank's notice of the same loss
    has arrived: whoever sent the first one had dialled everyone, and the ranks told start to
    tear down. At 256 ranks on 2 cores the 8 ranks that saw the loss themselves each went on
    dialling 240 peers with ~1% of a CPU while the ranks told exited, and named the loss up to
    10 s after them (docs/PERFORMANCE.md, 2026-11-28)."""
    h = encode_header(Header(ABORT, ep.group, seq, ep.rank, lost or 0, 0, 0, 0, len(report)))
    try:
        peers = list(ep._out) if connected_only else ep.all_peers("an abort notice", lost)
    except CommError as exc:  # the addresses not known yet are unreadable: tell those we know
        log.warning("rank %d: abort notice to known peers only: %s", ep.rank, exc)
        peers = list(ep.peer_addresses)
    peers = [p for p in peers if p not in (ep.rank, lost)]
    socks = [ep._out[p] for p in peers if p in ep._out]
    for peer in peers:
        if peer in ep._out:
            continue
        if lost is not None and _heard_of(ep, lost):
            break
        try:
            socks.append(ep.socket_to(peer, "an abort notice", watch=False))
        except (zmq.ZMQError, ValueError):
            pass
    for sock in socks:
        try:
            sock.send_multipart([h, report], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass


def _heard_of(ep, lost: int) -> bool:
    """Whether another rank's notice naming ``lost`` has arrived. Reads what is queued and drops
    it: the group is unusable from now on, and nothing will read it after this."""
    while (msg := ep.read(zmq.NOBLOCK)) is not None:
        h = msg.header
        if h.kind == ABORT and h.nbytes == 0 and h.op == lost and not is_goodbye(h):
            return True
    return False


def say_goodbye(ep) -> dict[int, int]:
    """Best effort, never blocking: tell the peers we send to, and those that sent to us
    (their connections to us are what their liveness watches), that this rank closes the
    group on purpose (``is_goodbye``). Not to a peer whose connection is already down: the
    message would sit out the close linger (a destroy took 1 s instead of 0.1 s when its
    peer had left first). Returns the linger (ms) of each socket dialled only for this."""
    bye = encode_header(Header(ABORT, ep.group, 0, ep.rank, ep.rank, 0, 0, 0, 0))
    heard = [p for p, c in enumerate(ep._counters) if c.recv_msgs and p in ep.peer_addresses]
    ep.live.watch()
    lingers = {}
    for peer in set(ep._out) | set(heard):
        if peer in ep.live.down or peer == ep.rank:
            continue
        if peer not in ep._out:
            lingers[peer] = GOODBYE_LINGER_MS
        try:
            ep.socket_to(peer, "a goodbye").send_multipart([bye, b""], zmq.NOBLOCK)
        except (zmq.ZMQError, ValueError, CommError):
            pass
    return lingers
