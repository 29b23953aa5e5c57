"""One replica of a fault-tolerant data-parallel job (tests/multirank/test_replica_ft.py).

    python -m tests.multirank.programs.replica_ft_job REPLICA REPLICAS HOST:PORT STEPS OUT
        [--die-at STEP] [--freeze-at STEP] [--pause S] [--off]

Trains a small MLP with AdamW on data that depends only on (replica, step); writes OUT.json
(history: per applied step the replicas averaged; counts; per-step times) and OUT.pt (the final
parameters). ``--die-at`` SIGKILLs this process after the backward of that step, before its
gradients are averaged (a death mid-step). ``--freeze-at`` writes OUT.frozen there instead and
waits (at most 120 s) for the test to cut the node's link and SIGKILL it, the emulated node's
death (tests/multirank/test_replica_ft_emulated.py). ``--off`` runs the same loop over a plain commrt
world and DataParallel-style averaging (fault tolerance off), for the overhead figure.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
from torch import nn

from commrt.train import replica_state
from commrt.train import replica_vote as rv
from commrt.train.replica_ft import ReplicaFT

SEED = 0


def make_model(width: int = 64, seed: int | None = SEED) -> nn.Module:
    if seed is not None:
        torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + replica)
    return torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)


def local_backward(model: nn.Module, replica: int, step: int) -> None:
    x, y = batch(replica, step)
    nn.functional.mse_loss(model(x), y).backward()


class Twin(nn.Module):
    """Two 600 x 600 layers: one gradient bucket each, of the same size (replica_overlap's
    first-bucket cap is 256 Ki elements). Replica 1 leaves ``b`` out of its forward, as a branch
    a batch does not take: ``b``'s bucket fills on the other replicas only."""

    def __init__(self, seed: int | None = SEED):
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self.a, self.b = nn.Linear(600, 600, bias=False), nn.Linear(600, 600, bias=False)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h) if use_b else h


def twin_backward(model: Twin, replica: int, step: int) -> None:
    g = torch.Generator().manual_seed(7919 * step + replica)
    x, y = torch.randn(8, 600, generator=g), torch.randn(8, 600, generator=g)
    nn.functional.mse_loss(model(x, replica != 1), y).backward()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("replica", type=int)
    p.add_argument("replicas", type=int)
    p.add_argument("store")
    p.add_argument("steps", type=int)
    p.add_argument("out")
    p.add_argument("--die-at", type=int, default=-1)
    p.add_argument("--freeze-at", type=int, default=-1)
    p.add_argument("--pause", type=float, default=0.0)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--off", action="store_true")
    p.add_argument("--no-overlap", action="store_true", help="ReplicaFT(overlap=False): all-reduce after backward")
    p.add_argument("--shards", type=int, default=1, help="ranks per replica group (REPLICA is the group)")
    p.add_argument("--shard", type=int, default=0, help="this rank's index in its group")
    p.add_argument("--progress", action="store_true", help="append 'step time members' to OUT.progress per step")
    p.add_argument("--twin", action="store_true", help="the Twin model: a parameter unused on replica 1")
    p.add_argument("--mask", action="store_true", help="a bool buffer (a causal mask), set on replica 0 only")
    p.add_argument("--wait-for", default="", help="start only once this file exists (at most 120 s): the test "
                   "starts the process early (its imports are slow on a loaded host) and lets it join when it must")
    p.add_argument("--fault", default="", help="WHAT:WHERE:STEP (inject_fault): kill or stop (SIGKILL / "
                   "SIGSTOP) this replica at a point of step STEP: all_reduce, vote, apply, sync, lead or open")
    a = p.parse_args()
    # the state transfer packs tensors into broadcasts of at most CAP_BYTES: small ones here (every
    # replica alike), so that it goes in several and a fault can land in the middle of it
    replica_state.CAP_BYTES = 4096
    torch.set_num_threads(1)
    # a replica that is not the source starts from other values: the first generation's sync must fix that
    seed = SEED if a.replica == 0 else None
    model = Twin(seed) if a.twin else make_model(a.width, seed)
    backward = twin_backward if a.twin else local_backward
    if a.mask:  # the others' differs: the first generation's sync must fix it
        model.register_buffer("mask", torch.ones(4, 4).tril().bool() if a.replica == 0 else torch.zeros(4, 4).bool())
    opt = make_optimizer(model)
    if a.off:
        return _off(model, opt, a)
    if a.shards > 1:  # a replica group: the optimizer is made over this rank's flat slice
        opt = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    deadline = time.monotonic() + 120.0
    while a.wait_for and not os.path.exists(a.wait_for) and time.monotonic() < deadline:
        time.sleep(0.05)
    ft = ReplicaFT(model, opt, a.replica, a.replicas, a.store, timeout_s=20.0, vote_timeout_s=3.0,
                   shard=a.shard, shards=a.shards, overlap=not a.no_overlap)
    if a.fault:
        inject_fault(ft, a.fault, a.out)
    data = a.replica * a.shards + a.shard  # the batch's index: every rank of a group reads its own
    started = time.time()
    step, times = ft.start(), {}
    joined_at = step
    while step < a.steps:
        t0 = time.perf_counter()
        backward(model, data, step)
        if step == a.die_at:
            with open(a.out + ".killed", "w") as fh:
                fh.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if step == a.freeze_at:
            with open(a.out + ".frozen", "w") as fh:
                fh.write(str(time.time()))
            time.sleep(120)  # the test kills us long before; if it does not, we go on and it fails
        step = ft.step()
        times[step - 1] = [time.time(), time.perf_counter() - t0]
        if a.progress:
            with open(a.out + ".progress", "a") as fh:
                fh.write(f"{step - 1} {times[step - 1][0]} {len(ft.stats()['members'])}\n")
        if a.pause:  # slower while short-handed: leaves a restarted replica time to join (on a loaded
            # host its torch import alone took 10-20 s: with a faster state transfer, the survivors
            # finished the job before the killed source came back, and it waited for a plan in vain)
            time.sleep(a.pause * (1 if len(ft.stats()["members"]) == a.replicas else 10))
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, a.out + ".pt")
    with open(a.out + ".json", "w") as fh:
        json.dump({"history": [[s, list(c)] for s, c in ft.history], "counts": ft.stats(), "times": times,
                   "started": started, "joined_at": joined_at}, fh)
    ft.close()


def inject_fault(ft: ReplicaFT, spec: str, out: str) -> None:
    """SIGKILL (``kill``) or SIGSTOP (``stop``: the test continues it) this process at a point of
    step STEP: ``all_reduce`` when the step's second gradient bucket is about to go out (the first
    is in flight), ``vote`` after the all-reduce before its vote, ``apply`` after the vote
    committed before the optimizer step, ``sync`` as the source of a state transfer to a replica
    (re)joining at step STEP or later, after a third of the tensors went out, ``lead`` as the
    leader of generation STEP before it writes the plan, ``open`` before opening generation
    STEP's world. Writes OUT.fault (the time) first."""
    what, where, at = spec.split(":")
    at, sig = int(at), {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[what]
    fired = []

    def fire() -> None:
        if fired:
            return
        fired.append(1)
        with open(out + ".fault", "w") as fh:
            fh.write(str(time.time()))
        os.kill(os.getpid(), sig)

    if where == "all_reduce":
        overlap, start = ft.grads.overlap, ft.grads.overlap._start
        overlap._start = lambda b: (fire() if b == 1 and ft.applied == at else None, start(b))[1]
    elif where == "vote":
        votes = ft._votes
        ft._votes = lambda ok: (fire() if ft.applied == at else None, votes(ok))[1]
    elif where == "apply":
        apply = ft.grads.apply
        ft.grads.apply = lambda *args: (fire() if ft.applied == at else None, apply(*args))[1]
    elif where == "sync":
        sync = ft._sync

        def wrapped(plan):
            if plan.fresh and plan.step >= at and plan.source == ft.replica:
                cast, sent = ft.rt.world.backend.broadcast, []
                total = len(replica_state.batches([replica_state.on_wire(t) for t in ft.model.parameters()],
                                                  replica_state.CAP_BYTES))

                def broadcast(t, src, async_op):
                    sent.append(1)
                    if len(sent) > 2 + total // 3:  # the description (its size, its bytes), then tensors
                        fire()
                    return cast(t, src, async_op)
                ft.rt.world.backend.broadcast = broadcast
            return sync(plan)
        ft._sync = wrapped
    elif where == "open":  # before opening generation STEP's world (the number is a generation here)
        opened = ft._open
        ft._open = lambda plan, me: (fire() if plan.gen == at else None, opened(plan, me))[1]
    elif where == "lead":  # as the leader of generation STEP (the number is a generation here)
        lead = rv.lead
        rv.lead = lambda store, gen, *args: (fire() if gen == at else None, lead(store, gen, *args))[1]
    else:
        raise SystemExit(f"--fault {spec!r}: WHERE must be all_reduce, vote, apply, sync, lead or open")


def _off(model: nn.Module, opt: torch.optim.Optimizer, a) -> None:
    """Fault tolerance off: the same loop over a commrt world with DataParallel (overhead baseline)."""
    import commrt
    from commrt.train import DataParallel
    host, port = a.store.rsplit(":", 1)
    commrt.init_process_group(init_method=f"tcp://{host}:{port}", rank=a.replica, world_size=a.replicas)
    dp = DataParallel(model)
    times = {}
    for step in range(a.steps):
        t0 = time.perf_counter()
        x, y = batch(a.replica, step)
        nn.functional.mse_loss(dp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times[step] = [time.time(), time.perf_counter() - t0]
    with open(a.out + ".json", "w") as fh:
        json.dump({"times": times}, fh)
    commrt.destroy_process_group()


if __name__ == "__main__":
    main()
