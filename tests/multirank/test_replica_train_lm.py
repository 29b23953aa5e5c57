"""``commrt.apps.train_lm`` with ``fault_tolerance = "replica"`` and HYBRID_SHARD (issue 33 item 2):
2 nodes x 2 ranks on loopback, each rank started with the variables ``commrt launch --nnodes 2
-n 2`` gives it (``launch.rank_env``), so a replica is a node's group of 2 ranks sharding the
gradients and the optimizer state (replica_group.py). Both ranks of node 1 are SIGKILLed once
they have applied a few steps; node 0 finishes alone. The store lives in this process (the
launcher's place, COMMRT_FT_STORE).

Checks: nothing hangs (every process has a deadline), every step is applied once, the step
node 1 died in and every later one are averaged over node 0 alone, and node 0's ranks end with
the parameters of a single-process reference that replays the membership per step (each
step's gradient is the mean over the contributing nodes' ranks, each on its own batch) within
1e-5. Restarting a group and its rejoin are tests/multirank/test_replica_ft_emulated.py's.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import torch
from torch import nn

from commrt.apps.train_lm import TinyLM, batch
from commrt.launch import free_port, rank_env
from commrt.runtime.config import load_config
from commrt.train.replica_ft import serve
from tests.multirank.harness import ROOT, default_signals

NODES, PER_NODE, STEPS, KILL_AFTER, LR = 2, 2, 60, 3, 0.05  # 57 steps after the kill: node 0 is never done first
MODEL = {"vocab": 64, "dim": 32, "layers": 1, "heads": 2, "seq": 16}
BATCH = 4
CONFIG = f"""
[train]
fault_tolerance = "replica"
manual_gc_interval = 5  # the collector at the job's step, across the node's death and rejoin
[train.zero_optimization]
sharding_strategy = "HYBRID_SHARD"
[train.optimizer]
type = "SGD"
params = {{lr = {LR}, momentum = 0.9}}
"""


def reference(history: list) -> dict:
    """One process: per step, the mean gradient over the contributing nodes' ranks."""
    torch.manual_seed(0)
    model = TinyLM(MODEL["vocab"], MODEL["dim"], MODEL["layers"], MODEL["heads"], MODEL["seq"])
    # SGD: Adam would turn the float noise of gradients that are zero in exact arithmetic (the
    # key's bias: softmax ignores a shift common to all scores) into steps of lr in either direction
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for step, nodes in history:
        ranks = [n * PER_NODE + s for n in nodes for s in range(PER_NODE)]
        grads = []
        for rank in ranks:
            model.zero_grad(set_to_none=True)
            tokens = batch(rank, step, BATCH, MODEL["seq"], MODEL["vocab"])
            loss_fn(model(tokens[:, :-1]).reshape(-1, MODEL["vocab"]), tokens[:, 1:].reshape(-1)).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / len(ranks)
        opt.step()
    return model.state_dict()


def _spawn(tmp_path, port: int, ft_port: int, rank: int) -> subprocess.Popen:
    env = rank_env(rank % PER_NODE, PER_NODE, port, config=str(tmp_path / "job.toml"), nnodes=NODES,
                   node_rank=rank // PER_NODE)
    env.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), COMMRT_FT_STORE=f"127.0.0.1:{ft_port}")
    args = [f"--{k}={v}" for k, v in MODEL.items()]
    cmd = [sys.executable, "-m", "commrt.apps.train_lm", *args, f"--batch={BATCH}", f"--steps={STEPS}",
           "--log-every=1", f"--out={tmp_path / 'r'}"]
    with open(tmp_path / f"rank{rank}.log", "w") as fh:
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=default_signals)


def _applied(tmp_path, rank: int) -> int:
    text = (tmp_path / f"rank{rank}.log").read_text()
    return max((int(m) for m in re.findall(r"step\s+(\d+) loss", text)), default=0)


def _logs(tmp_path) -> str:
    return "\n".join(f"--- rank {r} ---\n{(tmp_path / f'rank{r}.log').read_text()[-2500:]}"
                     for r in range(NODES * PER_NODE))


def test_a_node_of_an_hsdp_job_dies_and_the_other_finishes(tmp_path):
    (tmp_path / "job.toml").write_text(CONFIG)
    ft_port = free_port()
    transport, server = serve(load_config(), "127.0.0.1", ft_port)
    procs, victims = [], range(PER_NODE, 2 * PER_NODE)
    try:
        procs = [_spawn(tmp_path, free_port(), ft_port, r) for r in range(NODES * PER_NODE)]
        end = time.monotonic() + 120
        while _applied(tmp_path, victims[0]) < KILL_AFTER:
            assert time.monotonic() < end and all(p.poll() is None for p in procs), _logs(tmp_path)
            time.sleep(0.02)
        for r in victims:
            os.killpg(procs[r].pid, signal.SIGKILL)
        for p in procs:
            p.wait(timeout=max(end - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"a rank hung\n{_logs(tmp_path)}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        server.close()
        transport.close()
    assert [p.returncode for p in procs] == [0] * PER_NODE + [-signal.SIGKILL] * PER_NODE, _logs(tmp_path)
    runs = [json.load(open(tmp_path / f"r.{r}.json")) for r in range(PER_NODE)]
    history = runs[0]["history"]
    assert all(run["history"] == history for run in runs), "node 0's ranks applied different steps"
    assert [s for s, _ in history] == list(range(STEPS)), "a step was lost or applied twice"
    died = next(s for s, c in history if c == [0])
    assert died > KILL_AFTER - 1, f"node 1 was applied for {KILL_AFTER} steps before the kill: {history[:8]}"
    assert all(c == [0, 1] for _, c in history[:died]) and all(c == [0] for _, c in history[died:]), history
    assert runs[0]["stats"]["drops"] == 1 and runs[0]["stats"]["members"] == [0], runs[0]["stats"]
    ref = reference(history)
    for r in range(PER_NODE):
        got = torch.load(tmp_path / f"r.{r}.pt")
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, atol=1e-5, rtol=1e-5, msg=lambda m: f"rank {r}, {k}: {m}")
