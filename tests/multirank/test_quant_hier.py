"""Quantized collectives on a multi-node world (2 x 2, forced on loopback by the launcher's
node variables): only the inter-node hop is quantized, every rank equals a single-process
reference of the same steps bit for bit (programs/quant_hier.py)."""
from __future__ import annotations

import io
import re
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


def test_bench_quant_columns_beside_the_exact_op():
    """``commrt bench --quant int8,int4`` on the 2 x 2 layout: checked within the codec's bound;
    across nodes the two-hop path sends 1/M of the payload quantized (int8 0.254 / 1.5 of the
    flat ring's crossings; a flat quantized all-to-all would send 0.34x)."""
    out = io.StringIO()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "COMMRT_COMM_TIMEOUT_S": "60", "COMMRT_COMM_BACKEND": "zmq",
           "COMMRT_COMM_HIERARCHICAL": "always"}  # "auto" on loopback may measure flat as fast
    cmd = [sys.executable, "-m", "commrt.cli", "bench", "reduce_scatter", "--quant", "int8,int4", "-b", "1M",
           "-e", "1M", "-n", "2", "-w", "1"]
    result = launch(2, cmd, out=out, timeout_s=240, env=env, nodes=Nodes(2, None), prefix=False)
    text = out.getvalue()
    assert result.returncode == 0 and "zmq 0, zmq+int8 0, zmq+int4 0 (#wrong" in text, text[-4000:]
    across = {m[0]: int(m[1]) for m in re.findall(r"# (zmq\S*): sent inside nodes \d+ B, across nodes (\d+) B", text)}
    assert across["zmq+int8"] < 0.2 * across["zmq"] and across["zmq+int4"] < 0.1 * across["zmq"], text[-3000:]
