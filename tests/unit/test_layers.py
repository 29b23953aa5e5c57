"""The import graph of commrt/: no cycles (function-level imports included) and no layer
importing one above it. The allowed order is written once, here, bottom to top; a module
belongs to the tier of its longest matching prefix."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

TIERS = [
    # the vocabulary every layer speaks: typed errors, settings, dtypes, Work handles
    ["commrt.runtime.errors", "commrt.runtime.addresses", "commrt.runtime.dtypes", "commrt.runtime.arrays", "commrt.runtime.config",
     "commrt.runtime.work"],
    # pure pieces that depend on nothing above the vocabulary
    ["commrt.topology.nodes", "commrt.obs.flight", "commrt.obs.analyze", "commrt.obs.trace", "commrt.obs.comms",
     "commrt.obs.observer", "commrt.optim", "commrt.obs"],
    ["commrt.transport"],                    # everything on the wire
    ["commrt.runtime.store_core", "commrt.runtime.store", "commrt.runtime.store_proxy",
     "commrt.runtime.rendezvous"],
    ["commrt.collectives"],                  # algorithms and their executors over the transport
    ["commrt.backends"],                     # zmq (ours)
    ["commrt.integrations"],                 # gloo/nccl behind our API; torch's API over ours
    ["commrt.runtime"],                      # a world and its groups: bootstrap, group, world
    ["commrt.topology", "commrt.obs.stats"],  # device mesh, the two-level dispatch, comm_stats
    ["commrt.quant", "commrt.ps", "commrt.launch", "commrt.emulate"],
    ["commrt.distributed"],                  # the public API
    ["commrt.train", "commrt.pipeline"],
    ["commrt"],                              # the package's front door (its __init__ only): re-exports
    ["commrt.plan", "commrt.bench", "commrt.deploy", "commrt.apps"],  # programs over the front door
    ["commrt.cli"],                          # the commands
]


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_edges(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The commrt modules ``path`` imports, anywhere in the file (``from pkg import mod``
    counts as an import of ``pkg.mod``)."""
    me, is_pkg = module_name(path), path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me.split(".") if is_pkg else me.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                full = f"{mod}.{a.name}"
                if full in modules:
                    out.add(full)
                elif mod in modules:
                    out.add(mod)
    out.discard(me)
    return out


def tier(module: str) -> int | None:
    best, level = -1, None
    for i, prefixes in enumerate(TIERS):
        for p in prefixes:
            if (module == p or (module.startswith(p + ".") and p != "commrt")) and len(p) > best:
                best, level = len(p), i
    return level


def problems(graph: dict[str, set[str]]) -> list[str]:
    """Pure: modules without a tier, upward edges, and import cycles of ``graph``."""
    out = [f"{m} has no tier in TIERS" for m in graph if tier(m) is None]
    out += [f"{m} (tier {tier(m)}) imports {t} (tier {tier(t)}), a layer above it"
            for m, targets in graph.items() for t in targets
            if tier(m) is not None and tier(t) is not None and tier(t) > tier(m)]
    out += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp) + [sorted(comp)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def commrt_graph() -> dict[str, set[str]]:
    paths = sorted((ROOT / "commrt").rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): import_edges(p, modules) for p in paths}


def test_commrt_imports_downward_only_and_has_no_cycle():
    assert problems(commrt_graph()) == []


@pytest.mark.parametrize("planted, expected", [
    ({"commrt.quant.a": {"commrt.quant.b"}, "commrt.quant.b": {"commrt.quant.a"}}, "import cycle"),
    ({"commrt.transport.x": {"commrt.distributed"}, "commrt.distributed": set()}, "a layer above it"),
    ({"commrt.newthing": set()}, "has no tier"),
])
def test_the_check_finds_a_planted_cycle_an_upward_edge_and_an_unplaced_module(planted, expected):
    graph = {**commrt_graph(), **planted}
    found = problems(graph)
    assert any(expected in p for p in found), found


def test_a_planted_function_level_import_cycle_is_found(tmp_path):
    """The real parser, on files: a function-level import that closes a loop is a cycle too."""
    pkg = tmp_path / "commrt" / "quant"
    pkg.mkdir(parents=True)
    (tmp_path / "commrt" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from commrt.quant import b\n")
    (pkg / "b.py").write_text("def f():\n    from commrt.quant import a\n")
    paths = sorted((tmp_path / "commrt").rglob("*.py"))
    rel = {p: ".".join(p.relative_to(tmp_path).with_suffix("").parts) for p in paths}
    modules = {m[:-9] if m.endswith(".__init__") else m for m in rel.values()}
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        graph = {module_name(p): import_edges(p, modules) for p in paths}
    finally:
        ROOT = saved
    assert cycles(graph) == [["commrt.quant.a", "commrt.quant.b", "commrt.quant.a"]]


# -- the picture in docs/ARCHITECTURE.md: docs/layers.svg, drawn from this graph -------------------
# Regenerate with `python -m tests.unit.test_layers docs/layers.svg`; a test keeps it current.
SVG = ROOT / "docs" / "layers.svg"
_W, _ROW, _BOX_H, _PAD = 1100, 64, 40, 12


def boxes(graph: dict[str, set[str]]) -> dict[tuple[int, str], list[str]]:
    """(tier, package) -> its modules' short names: one box per package per tier."""
    out: dict[tuple[int, str], list[str]] = {}
    for m in sorted(graph):
        parts = m.split(".")
        pkg = parts[1] if len(parts) > 1 else "commrt"
        out.setdefault((tier(m), pkg), []).append(parts[-1] if len(parts) > 2 else "")
    return out


def render_svg(graph: dict[str, set[str]]) -> str:
    bx = boxes(graph)
    rows = sorted({t for t, _ in bx}, reverse=True)  # the top tier first
    pos = {}
    for y, t in enumerate(rows):
        keys = sorted(k for k in bx if k[0] == t)
        width = (_W - _PAD) / len(keys)
        for x, key in enumerate(keys):
            pos[key] = (_PAD + x * width, _PAD + y * _ROW, width - _PAD)
    where = {m: (tier(m), m.split(".")[1] if m.count(".") else "commrt") for m in graph}
    edges = {(where[m], where[t]) for m, ts in graph.items() for t in ts if where[m] != where[t]}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_PAD + len(rows) * _ROW}" '
           'font-family="monospace" font-size="11">', '<rect width="100%" height="100%" fill="white"/>']
    for a, b in sorted(edges):
        (xa, ya, wa), (xb, yb, wb) = pos[a], pos[b]
        out.append(f'<line x1="{xa + wa / 2:.0f}" y1="{ya + _BOX_H:.0f}" x2="{xb + wb / 2:.0f}" y2="{yb:.0f}" '
                   'stroke="#9ab" stroke-width="0.6"/>')
    for key, (x, y, w) in sorted(pos.items()):
        names = [n for n in bx[key] if n and n != "__init__"]
        single = f"commrt.{key[1]}" in graph and not any(m.startswith(f"commrt.{key[1]}.") for m in graph)
        label = "commrt/__init__ (front door)" if key[1] == "commrt" else f"{key[1]}.py" if single else f"{key[1]}/"
        detail = " ".join(names)
        detail = detail if len(detail) * 6.6 < w else f"{len(names)} modules"
        out.append(f'<rect x="{x:.0f}" y="{y:.0f}" width="{w:.0f}" height="{_BOX_H}" rx="4" fill="#eef4fb" '
                   'stroke="#456"/>')
        out.append(f'<text x="{x + 6:.0f}" y="{y + 16:.0f}" font-weight="bold">{label}</text>')
        out.append(f'<text x="{x + 6:.0f}" y="{y + 32:.0f}" fill="#345">{detail}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def test_the_layer_picture_is_current():
    """docs/layers.svg is what the import graph draws today (regenerate: see above)."""
    assert SVG.read_text() == render_svg(commrt_graph()), \
        "docs/layers.svg is stale: run `python -m tests.unit.test_layers docs/layers.svg`"


if __name__ == "__main__":
    import sys
    pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else SVG).write_text(render_svg(commrt_graph()))
