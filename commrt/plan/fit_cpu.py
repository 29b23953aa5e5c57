"""Fitting the simulator's network-and-CPU model to measured rows (issue 32.4): pure, numpy only.

A host with fewer cores than ranks is limited by its CPU, not its wires: eight ranks on two
cores take turns, and each message costs system calls and copies on both sides. ``Params``
are the model's free figures (a loopback message's latency and bandwidth, the CPU a message
and a byte cost each side, the reduction's speed) and the host's core count, which is known.
``fit`` finds the free ones by minimising the squared log error of the replayed times
(``plan.simulate``) against the measured ones, so a 4 KiB row counts as much as a 1 MiB one,
with a Nelder-Mead search over their logarithms (every figure stays positive, no scipy).

``network`` builds the same model for an emulated cluster: nodes of ``per_node`` ranks on one
host (all ranks share its cores), each node's link shaped to ``nic_bps`` bits/s. The shaper
counts Ethernet frames, so a TCP stream gets ``WIRE_PAYLOAD`` of the rate: nothing about the
emulated link is fitted, only the loopback figures carry over. Its token bucket is emulate.py's
(``burst``): bytes a link saved up while idle leave at the port's speed.

A benchmark times ops back to back, so a rank starts the next op as soon as its part of the last
is done and a link's bucket refills only in the gaps: ``predict`` replays ``WARM`` and ``REPEAT``
ops back to back and takes the time per op of those after the first ``WARM`` (the benchmark's
warm-up drains the bucket too), or, given a case's ``warmup`` and ``iters``, the benchmark's own
loop: how full the bucket still is depends on how many ops ran.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np

from commrt.plan.network import Network
from commrt.plan.simulate import simulate

WIRE_PAYLOAD = 1448 / 1514  # TCP payload (MSS with timestamps) per 1500-byte-MTU frame on the wire
WARM, REPEAT = 2, 4  # ops replayed back to back; the time per op is that of the last REPEAT - WARM


def burst(nic_bps: float) -> float:
    """The bucket emulate.py gives tc's tbf: 10 ms of the rate, at least 64 KiB."""
    return max(64 << 10, int(nic_bps / 8 / 100))


class Params(NamedTuple):
    alpha: float       # seconds, a loopback message's latency (not CPU)
    beta: float        # bytes/s, a loopback message's bandwidth
    cpu_msg: float     # CPU seconds per message, each side
    cpu_byte: float    # CPU seconds per byte, each side
    reduce_bw: float   # bytes/s reduced
    cores: int         # the host's cores (0: one per rank)
    sharing: str = "fcfs"  # how a link serves concurrent messages (Network.sharing), not fitted

    def describe(self) -> str:
        return (f"alpha {self.alpha * 1e6:.1f} us, beta {self.beta / 1e9:.3f} GB/s, cpu_msg {self.cpu_msg * 1e6:.1f} us, "
                f"cpu_byte {self.cpu_byte * 1e9:.3f} ns/B, reduce {self.reduce_bw / 1e9:.3f} GB/s, cores {self.cores}, "
                f"links {self.sharing}")


class Case(NamedTuple):
    collective: str
    algorithm: str
    world: int
    nbytes: int
    per_node: int = 0      # 0: every rank on one node (loopback)
    nic_bps: float = 0.0   # an emulated node link's shaped rate, bits/s
    warmup: int = 0        # the benchmark's untimed ops, then ``iters`` timed ones (0: WARM, REPEAT)
    iters: int = 0
    alone: bool = False    # measured alone (a barrier before each op): one op, the link rested


def network(p: Params, world: int, per_node: int = 0, nic_bps: float = 0.0, rested: bool = True) -> Network:
    """``rested``: the node links' buckets start full (a link idle for longer than its bucket
    takes to fill, 10 ms of the rate); else empty."""
    cpu = dict(cpu_msg=p.cpu_msg, cpu_byte=p.cpu_byte, reduce_bw=p.reduce_bw, cores=p.cores, sharing=p.sharing)
    if not per_node or per_node >= world:
        return Network(world=world, per_node=world, intra_latency=p.alpha, intra_bw=p.beta, **cpu)
    if nic_bps <= 0:
        raise ValueError(f"{world} ranks in nodes of {per_node}: the node link's rate is needed (nic_bps > 0)")
    return Network(world=world, per_node=per_node, intra_latency=p.alpha, intra_bw=p.beta, nic_latency=0.0,
                   nic_bw=nic_bps / 8 * WIRE_PAYLOAD, nic_burst=burst(nic_bps) * WIRE_PAYLOAD if rested else 0.0, ranks_per_host=world,
                   **cpu)


def predict(p: Params, case: Case, back_to_back: bool = True) -> float:
    """Seconds per op: one op alone, or (``back_to_back``) one of a loop of them. A case measured
    alone (``bench --mode alone``: a barrier, then one op) is one op whose links' buckets the
    ops before drained: the barrier between them is ~1 ms, a tenth of a bucket's refill (at 2 x 2,
    100 Mbit, 64 KiB alone took 10.6 ms by doubling, the bytes' time at the rate: 11.0 ms)."""
    if case.alone:
        return simulate(network(p, case.world, case.per_node, case.nic_bps, rested=False), case.collective,
                        case.algorithm, case.nbytes).seconds
    net = network(p, case.world, case.per_node, case.nic_bps)
    if not back_to_back:
        return simulate(net, case.collective, case.algorithm, case.nbytes).seconds
    first, last = (case.warmup, case.warmup + case.iters) if case.iters else (WARM, REPEAT)
    warm, loop = (simulate(net, case.collective, case.algorithm, case.nbytes, repeat=k).seconds for k in (first, last))
    return (loop - warm) / (last - first)


def nelder_mead(f: Callable[[np.ndarray], float], x0: Sequence[float], step: float = 1.0,
                iters: int = 400, tol: float = 1e-6) -> np.ndarray:
    """The minimum of ``f`` near ``x0`` (the textbook simplex: reflect, expand, contract, shrink)."""
    n = len(x0)
    simplex = [np.asarray(x0, float)] + [np.asarray(x0, float) + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centre = np.mean(simplex[:-1], axis=0)
        worst = simplex[-1]
        refl = centre + (centre - worst)
        fr = f(refl)
        if fr < values[0]:
            exp = centre + 2 * (centre - worst)
            fe = f(exp)
            simplex[-1], values[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = refl, fr
        else:
            con = centre + 0.5 * (worst - centre)
            fc = f(con)
            if fc < values[-1]:
                simplex[-1], values[-1] = con, fc
            else:
                simplex = [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


def _params(x: np.ndarray, cores: int, sharing: str = "fcfs") -> Params:
    alpha, inv_beta, msg, byte, inv_reduce = np.exp(x)
    return Params(alpha, 1 / inv_beta, msg, byte, 1 / inv_reduce, cores, sharing)


def error(p: Params, cases: Sequence[Case], seconds: Sequence[float], back_to_back: bool = True) -> float:
    """Mean squared log ratio of predicted to measured."""
    pred = np.array([predict(p, c, back_to_back) for c in cases])
    return float(np.mean(np.log(pred / np.asarray(seconds)) ** 2))


def fit(cases: Sequence[Case], seconds: Sequence[float], cores: int, start: Params | None = None,
        rounds: int = 3, back_to_back: bool = True, sharing: str = "fcfs") -> Params:
    """The Params (``cores`` and the links' ``sharing`` given) whose replay is closest to the measured ``seconds``."""
    if len(cases) < 5:
        raise ValueError(f"fitting 5 figures needs >= 5 measured rows, got {len(cases)}")
    s = start or Params(20e-6, 1e9, 20e-6, 0.5e-9, 1e9, cores)
    x = np.log([s.alpha, 1 / s.beta, s.cpu_msg, s.cpu_byte, 1 / s.reduce_bw])
    for _ in range(rounds):  # restarts: a simplex can collapse before it reaches the minimum
        x = nelder_mead(lambda v: error(_params(v, cores, sharing), cases, seconds, back_to_back), x)
    return _params(x, cores, sharing)
