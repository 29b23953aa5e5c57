"""A parameter-server worker that starts late, dies, comes back or pauses where a test says
(issue 33 item 3). The model, batches and gradients are ps_job's.

    ps_join OUT STEPS [--turns J] [--pause-at P --pausers 0,1 --pause-until NAME]
                      [--kill-at K] [--announce NAME] [--start-when 0,1,2]

--turns J: the workers take turns, one push_pull at a time in the order (step, worker), the
  last worker taking part from step J on; a turn waits for OUT/done-<w>-<t> of the one before, so
  the run is deterministic and a single process can replay it.
--pause-at P: before step P, touch OUT/paused-<w>, wait until every pauser has, pull, save the
  weights to OUT/paused-<w>.npy (the servers' weights: nobody pushes meanwhile), then wait for
  OUT/<NAME>.
--kill-at K: SIGKILL itself after step K.
--start-when: push nothing before these workers have pulled (OUT/ready-<w>): a worker slow to
  start must not be taken for a lost one.
--announce NAME: after init and the first pull, save those weights to OUT/start-<w>.npy and
  the servers' counters to OUT/start-<w>.json, print the starting step, touch OUT/<NAME>.
At the end: OUT/final-<w>.npy and OUT/stats-<w>.json. Every wait has a deadline; errors print
'CAUGHT <type>: <message>'.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

from commrt.ps import PSClient
from commrt.runtime.config import load_config
from commrt.runtime.errors import CommError
from tests.multirank.programs.ps_job import batch, grads_of, make_params

WAIT_S = 90.0


def wait_for(path: str, worker: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {worker}: waited {WAIT_S:g}s for {path}")
        time.sleep(0.01)


def touch(path: str) -> None:
    open(path, "w").close()


def flat(params) -> np.ndarray:
    return np.concatenate([v.numpy().ravel() for v in params.values()])


def turn_before(worker: int, step: int, join: int, initial: int, workers: int) -> list[str]:
    """The files a turn waits for: the turn before it in (step, worker) order."""
    def members(t):
        return list(range(initial)) + ([workers - 1] if t >= join else [])
    order = members(step)
    if worker not in order:
        raise RuntimeError(f"worker {worker} has no turn at step {step}: the turns are {order}")
    i = order.index(worker)
    if i > 0:
        return [f"done-{order[i - 1]}-{step}"]
    if step == 0:
        return [f"ready-{w}" for w in range(initial)]
    return [f"done-{members(step - 1)[-1]}-{step - 1}"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("steps", type=int)
    p.add_argument("--turns", type=int, default=-1)
    p.add_argument("--pause-at", type=int, default=-1)
    p.add_argument("--pausers", default="")
    p.add_argument("--pause-until", default="")
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--announce", default="")
    p.add_argument("--start-when", default="")
    args = p.parse_args()
    at = lambda name: os.path.join(args.out, name)  # noqa: E731
    client = PSClient(load_config())
    w, ps = client.worker, client.cfg.ps
    params = make_params()
    try:
        client.init(params)
        client.pull(params)
        touch(at(f"ready-{w}"))
        if args.announce:
            np.save(at(f"start-{w}.npy"), flat(params), allow_pickle=False)
            with open(at(f"start-{w}.json"), "w") as f:
                json.dump(client.stats(), f)
            print(f"worker {w} starts at step {client.step}", flush=True)
            touch(at(args.announce))
        for other in filter(None, args.start_when.split(",")):
            wait_for(at(f"ready-{other}"), w)
        for step in range(client.step, args.steps):
            if step == args.pause_at:
                touch(at(f"paused-{w}"))
                for other in args.pausers.split(","):
                    wait_for(at(f"paused-{other}"), w)
                client.pull(params)
                np.save(at(f"paused-{w}.npy"), flat(params), allow_pickle=False)
                wait_for(at(args.pause_until), w)
            if args.turns >= 0:
                for name in turn_before(w, step, args.turns, ps.initial_workers or ps.workers, ps.workers):
                    wait_for(at(name), w)
            client.push_pull(grads_of(params, *batch(w, step)), params)
            touch(at(f"done-{w}-{step}"))
            if step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    except CommError as exc:
        print(f"CAUGHT {type(exc).__name__}: {exc}", flush=True)
        return 0
    np.save(at(f"final-{w}.npy"), flat(params), allow_pickle=False)
    with open(at(f"stats-{w}.json"), "w") as f:
        json.dump(client.stats(), f)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
