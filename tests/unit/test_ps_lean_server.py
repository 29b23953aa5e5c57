"""A parameter-server shard is a rank that costs little: it keeps numpy arrays and does the
optimizer's arithmetic in numpy, so its process never imports torch (2.7 s and hundreds of MiB
per shard). The server runs in a process of its own; the client is this one."""
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from commrt.launch import free_port
from commrt.optim import numpy_rules, rules
from commrt.ps.client import PSClient
from commrt.runtime.config import load_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVE = """
import sys
from commrt.runtime.config import load_config
from commrt.ps.server import Server, install_signal_handlers
cfg = load_config(overrides={overrides!r}, environ={{}})
server = Server(cfg, 0)
install_signal_handlers(server)
print("LISTENING", flush=True)
status = server.serve()
print("TORCH", "torch" in sys.modules, "STATUS", status, flush=True)
"""


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "lamb"])
def test_a_shard_serves_a_push_and_a_pull_without_importing_torch(optimizer, tmp_path):
    overrides = {"ps": {"servers": [f"tcp://127.0.0.1:{free_port()}"], "workers": 1, "lr": 0.5, "timeout_s": 10,
                        "optimizer": optimizer, "momentum": 0.9 if optimizer == "sgd" else 0.0,
                        "checkpoint_dir": str(tmp_path)},
                 "security": {"mode": "none"}}
    proc = subprocess.Popen([sys.executable, "-c", SERVE.format(overrides=overrides)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    client = None
    try:
        assert proc.stdout.readline().strip() == "LISTENING"
        client = PSClient(load_config(overrides=overrides, environ={}), worker=0)
        w = np.linspace(-1, 1, 6, dtype=np.float32)
        client.init({"w": w})
        ref, grads = torch.from_numpy(w.copy()), [np.ones(6, np.float32), np.linspace(2, -3, 6, dtype=np.float32)]
        spec = rules.OptimSpec(optimizer, lr=0.5, momentum=overrides["ps"]["momentum"])
        state = rules.init_state(spec, ref)
        got = np.empty(6, np.float32)
        for step, g in enumerate(grads, 1):
            client.push_pull({"w": g}, {"w": got})
            rules.step_(ref, torch.from_numpy(g), state, spec, step)  # torch's arithmetic, in this process
            np.testing.assert_allclose(got, ref.numpy(), rtol=0, atol=1e-6)
    finally:
        if client is not None:
            client.close()
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    assert "TORCH False STATUS 0" in out, out


@pytest.mark.parametrize("kind,kw", [
    ("sgd", dict(lr=0.1)), ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True)), ("adamw", dict(lr=0.01, weight_decay=0.1)),
    ("adamw", dict(lr=0.01, beta1=0.2)),  # the other side of torch.lerp_'s formula
    ("lamb", dict(lr=0.05, weight_decay=0.01)),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_numpy_rules_step_like_the_torch_rules(kind, kw, dtype):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(300).astype(dtype)
    spec = rules.OptimSpec(kind, **kw)
    mine, ref = w.copy(), torch.from_numpy(w.copy())
    mine_state, ref_state = numpy_rules.init_state(spec, mine), rules.init_state(spec, ref)
    for step in range(1, 8):
        g = rng.standard_normal(300).astype(dtype)
        before = g.copy()
        numpy_rules.step_(mine, g, mine_state, spec, step)
        rules.step_(ref, torch.from_numpy(g.copy()), ref_state, spec, step)
        assert np.array_equal(g, before), "the gradient was written"
    np.testing.assert_allclose(mine, ref.numpy(), rtol=0, atol=1e-6 if dtype == np.float32 else 1e-12)
    for name in mine_state:
        np.testing.assert_allclose(mine_state[name], ref_state[name].numpy(), rtol=0, atol=1e-6)


WORKER = """
import sys, threading
import numpy as np
from commrt.runtime.config import load_config
from commrt.ps import PSClient
from commrt.ps.server import Server
cfg = load_config(overrides={overrides!r}, environ={{}})
server = Server(cfg, 0)
serving = threading.Thread(target=server.serve, daemon=True)
serving.start()
client = PSClient(cfg, worker=0)
w = np.arange(12, dtype=np.float32).reshape(3, 4)
client.init({{"w": w, "b": np.ones(5, np.float64)}})
grid = np.zeros((3, 8), np.float32)  # a strided view to land in
client.push_pull({{"w": np.ones((3, 4), np.float32), "b": np.ones(5)}}, {{"w": grid[:, ::2]}})
b = np.zeros(5)
client.pull({{"b": b}})
client.close()
server.stop()
serving.join(10)
print("W", grid[:, ::2].ravel().tolist(), "GAPS", float(np.abs(grid[:, 1::2]).sum()), "B", b.tolist())
print("TORCH", "torch" in sys.modules, flush=True)
"""


def test_a_numpy_only_worker_never_imports_torch():
    """A worker that passes numpy arrays only (issue 32.2's promise for the collectives) loaded
    torch for the client's views of its arrays."""
    overrides = {"ps": {"servers": [f"tcp://127.0.0.1:{free_port()}"], "workers": 1, "lr": 0.5, "timeout_s": 10},
                 "security": {"mode": "none"}}
    proc = subprocess.run([sys.executable, "-c", WORKER.format(overrides=overrides)], cwd=ROOT, text=True,
                          capture_output=True, timeout=120)
    expected = (np.arange(12) - 0.5).tolist()
    assert f"W {expected} GAPS 0.0 B {[0.5] * 5}" in proc.stdout, proc.stdout + proc.stderr
    assert "TORCH False" in proc.stdout, proc.stdout + proc.stderr
