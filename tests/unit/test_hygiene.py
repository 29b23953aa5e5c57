"""Standing checks on the source tree: no unsafe deserialisation, layers import downward."""
import ast
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
CODE = [p for d in ("commrt", "servers", "workers") for p in (ROOT / d).rglob("*.py")]
UNSAFE = re.compile(r"import pickle|from pickle|cPickle|recv_pyobj|send_pyobj|\beval\(|\bexec\(|torch\.load\(")

# a module may import only from its own layer or the ones listed below it
LAYERS = ["errors", "wire", "config", "dtypes", "security", "transport", "store", "work", "collectives",
          "backends", "rendezvous", "group", "bootstrap", "distributed", "bench", "apps", "launch", "cli"]
ALLOWED = {
    # the transport applies the security mode to every socket it makes
    "transport": {"errors", "wire", "config", "security"},
    "collectives": {"errors", "wire", "dtypes", "transport", "config"},
    "backends": {"errors", "wire", "dtypes", "transport", "collectives", "config", "work"},
    # the parameter server sits beside the collectives: it never reaches into them (it uses
    # the transport layer's process-level memory setting, not its sockets)
    "ps": {"errors", "config", "dtypes", "work", "optim", "security", "transport"},
    # quantized collectives: compositions of the public API's exact collectives on bytes
    # (and the world's node groups from mesh, for the two-hop path on multi-node worlds)
    "quant": {"errors", "config", "dtypes", "collectives", "distributed", "stats", "mesh"},
    # training layers: over the public API (distributed), the optimizer math, the PS file format
    # and the quantized collectives
    # (and the topology through mesh: the node size that hybrid sharding and hpZ default to;
    # work: ZeRO++'s comm stream (train/stream.py) is an Executor)
    "train": {"errors", "config", "optim", "collectives", "distributed", "ps", "quant", "mesh", "work"},
    # pipeline parallelism: over the public API's point-to-point calls, like train
    "pipeline": {"errors", "config", "dtypes", "collectives", "distributed", "train"},
    # commrt estimate: pure formulas over the layers it predicts (their plans, codecs, schedules)
    # (and, for --measure inside a launched job, the public API: it joins the job to time its links)
    "plan": {"errors", "config", "train", "quant", "collectives", "mesh", "distributed"},
    # scheduler recipes: pure mappings over config and errors; the ssh launcher reuses the local
    # launcher's output pumping (commands sit at the top, beside launch)
    "deploy": {"errors", "config", "launch"},
    # observability, under the public API that feeds it: Work (async completion), the typed
    # errors that trigger a flight dump, and bench/metrics.py's nccl-tests bus factors (pure)
    "obs": {"errors", "config", "work", "bench"},
    # the torch.distributed backend "commrt": a ProcessGroup over one ZmqBackend per group,
    # bootstrapped through torch's store (rendezvous, store's adapter) on the process's Transport
    "tdist": {"errors", "config", "dtypes", "collectives", "backends", "transport", "work", "rendezvous",
              "security", "store"},
}


def test_no_unsafe_deserialisation():
    hits = [f"{p.relative_to(ROOT)}:{i + 1}" for p in CODE
            for i, line in enumerate(p.read_text().splitlines())
            if UNSAFE.search(line) and "weights_only=True" not in line]
    assert not hits, f"unsafe deserialisation: {hits}"


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            parts = (node.module or "").split(".")
            rel = path.relative_to(ROOT / "commrt").parts
            depth = len(rel) - node.level  # package depth the import resolves to
            base = list(rel[:depth]) + [p for p in parts if p]
            if base:
                names.add(base[0])
            else:
                names.update(a.name for a in node.names)
    return names


def test_layers_import_downward_only():
    bad = []
    for layer, allowed in ALLOWED.items():
        for path in (ROOT / "commrt" / layer).rglob("*.py"):
            for name in _imports(path) - allowed - {layer}:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_the_distribution_installs_only_commrt(tmp_path):
    """servers/ and workers/ are entry folders of this repository, not packages for site-packages,
    where generic top-level names would clash with other distributions."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("commrt", "servers", "workers"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("commrt-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        top = {name.split("/")[0] for name in zf.namelist() if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"commrt"}, top


def test_no_multiprocessing_shared_memory():
    """Its resource tracker unlinks a segment when any process that attached it exits (cpython
    82300): the shared-memory transport maps /dev/shm files itself (commrt/transport/shm.py)."""
    hits = [str(p.relative_to(ROOT)) for p in CODE if re.search(r"import.*shared_memory|SharedMemory\(", p.read_text())]
    assert not hits, hits
