"""Standing checks on the source tree: no unsafe deserialisation (layers: test_layers.py)."""
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
CODE = [p for d in ("commrt", "servers", "workers") for p in (ROOT / d).rglob("*.py")]
UNSAFE = re.compile(r"import pickle|from pickle|cPickle|recv_pyobj|send_pyobj|\beval\(|\bexec\(|torch\.load\(")

def test_no_unsafe_deserialisation():
    hits = [f"{p.relative_to(ROOT)}:{i + 1}" for p in CODE
            for i, line in enumerate(p.read_text().splitlines())
            if UNSAFE.search(line) and "weights_only=True" not in line]
    assert not hits, f"unsafe deserialisation: {hits}"


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
    82300): the shared-memory transport maps memory files itself (commrt/transport/segments.py)."""
    hits = [str(p.relative_to(ROOT)) for p in CODE if re.search(r"import.*shared_memory|SharedMemory\(", p.read_text())]
    assert not hits, hits
