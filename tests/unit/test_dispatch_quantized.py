"""[comm] hierarchical = "auto" for quantized collectives (topology/dispatch.py): the probe
compares exact all_reduces, and its verdict must not send a quantized op down the flat path,
whose codes for every chunk of another node cross the slow link (ZeRO++ qgZ's hierarchy sends
only the node sums'). The runtime's decision, over a runtime record the probe has decided on."""
import types

from commrt.runtime import world
from commrt.runtime.config import load_config
from commrt.topology import dispatch


def _runtime(mode: str, flat_won: bool):
    cfg = load_config(overrides={"comm": {"hierarchical": mode}}, environ={})
    topo = types.SimpleNamespace(num_nodes=2, per_node=lambda: 2)
    rt = types.SimpleNamespace(config=cfg, topology=topo, world=object(),
                               extras={"hierarchical_auto": dispatch.AutoChoice(not flat_won, 1.0, 1.05, 8 << 20)})
    return rt


def test_auto_takes_two_levels_for_quantized_ops_when_the_probe_kept_exact_ones_flat(monkeypatch):
    rt = _runtime("auto", flat_won=True)
    monkeypatch.setattr(world, "current", lambda: rt)
    big, small = 1 << 20, 1 << 10
    assert not dispatch.wants_hierarchical(None, big)  # the exact op follows the probe
    assert dispatch.wants_hierarchical(None, big, quantized=True)
    assert not dispatch.wants_hierarchical(None, small, quantized=True)  # below small_bytes per rank's part
    assert not dispatch.wants_hierarchical(object(), big, quantized=True)  # not the world group
    rt.config = load_config(overrides={"comm": {"hierarchical": "never"}}, environ={})
    assert not dispatch.wants_hierarchical(None, big, quantized=True)
