"""Quantized collectives on a multi-node world (2 x 2, forced on loopback by the launcher's
node variables): only the inter-node hop is quantized, every rank equals a single-process
reference of the same steps bit for bit (programs/quant_hier.py)."""
from __future__ import annotations

import io
import os
import sys

from commrt.launch import Nodes, launch
from tests.multirank.harness import ROOT


def test_quantized_calls_go_two_hop_on_a_multi_node_world():
    out = io.StringIO()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "COMMRT_COMM_TIMEOUT_S": "60", "COMMRT_COMM_BACKEND": "zmq", "COMMRT_COMM_HIERARCHICAL": "always"}
    result = launch(2, [sys.executable, "-m", "tests.multirank.programs.quant_hier"], out=out, timeout_s=240,
                    env=env, nodes=Nodes(2, None))
    text = out.getvalue()
    assert result.returncode == 0 and text.count("quant hier passed") == 4, f"{result.describe()}\n{text[-6000:]}"
