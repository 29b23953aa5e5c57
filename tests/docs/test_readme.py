"""The README's walk-throughs, run exactly as written (issue 31.8), so the README cannot drift.

Every ```bash fence under "## Walk-throughs" is one case: its text runs in bash from the
repository root after the README's own activation fence (``source .venv/bin/activate``, which
``bash deploy/install.sh`` makes possible), with ``-e -o pipefail`` so that any failing command
fails the case. An HTML comment right before a fence marks it: ``<!-- docs-test: slow -->`` (left
out by default, ``-m slow`` runs it), ``root`` (network namespaces: skipped unless root with
``ip``), ``needs matplotlib`` (skipped without the ``plot`` extra).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import re
import shutil
import signal
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SECTION = "## Walk-throughs"
FENCE = re.compile(r"(?:<!--\s*docs-test:\s*(?P<marks>[^>]*?)\s*-->\s*\n)?```bash\n(?P<body>.*?)```", re.S)
ACTIVATE = "source .venv/bin/activate"
CASE_TIMEOUT_S = 240


@dataclasses.dataclass(frozen=True)
class Block:
    title: str            # the ### heading it sits under
    body: str             # the fence's text, as written
    marks: frozenset[str]


def section(text: str, heading: str = SECTION) -> str:
    """The text from ``heading`` to the next level-2 heading."""
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def blocks(text: str) -> list[Block]:
    """The bash fences of the walk-throughs section, each with its heading and marks."""
    out, body = [], section(text)
    for m in FENCE.finditer(body):
        heads = re.findall(r"^### (.+)$", body[:m.start()], re.M)
        marks = frozenset(x.strip() for x in (m.group("marks") or "").split(",") if x.strip())
        out.append(Block(heads[-1] if heads else "(intro)", m.group("body"), marks))
    return out


def env() -> dict:
    """The caller's environment, with this checkout first on the import path: in a fresh clone
    .venv's editable install points here anyway; in a worktree sharing another clone's .venv it
    makes the commands run this checkout's code."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")]))
    for name in [k for k in e if k.startswith("COMMRT_")]:
        del e[name]  # the README's commands set what they need; a stray setting must not change them
    return e


def run_block(body: str, timeout_s: float = CASE_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run ``body`` as the README shows it, after the activation fence, from the repository root.
    Whatever it left running (a server of a fence that failed before its ``kill``) is stopped
    with it: the fence runs in a session of its own, signalled as a whole at the end."""
    # a fence that fails early leaves its background servers holding our pipes: end them on exit
    script = f"set -e -o pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n{ACTIVATE}\n{body}"
    p = subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        out, err = "", f"timed out after {timeout_s}s"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _params():
    out = []
    for i, b in enumerate(blocks(README.read_text())):
        marks = [pytest.mark.slow] if "slow" in b.marks else []
        out.append(pytest.param(b, id=f"{i}-{re.sub(r'[^a-z0-9]+', '-', b.title.lower()).strip('-')}",
                                marks=marks))
    return out


def test_activation_fence_is_in_the_readme():
    """The commands rely on the activation the README tells users to do before them."""
    assert f"```bash\n{ACTIVATE}\n```" in README.read_text()


def test_every_job_has_a_walk_through():
    titles = {b.title for b in blocks(README.read_text())}
    for job in ("Parameter servers", "Swapping the backend", "Benchmarking bandwidth", "emulated"):
        assert any(job in t for t in titles), f"no walk-through fence under a heading naming {job!r}: {titles}"
    text = section(README.read_text())
    for word in ("ZeRO", "hpZ", "quantiz", "pipeline"):
        assert word in text, f"the walk-throughs no longer mention {word}"


def test_a_failing_command_fails_its_case():
    """The harness itself: a README command that fails (here a missing config file) fails the case
    even when later commands of the fence succeed."""
    res = run_block("commrt config docs/configs/no_such_file.toml\necho after\n", timeout_s=120)
    assert res.returncode != 0 and "after" not in res.stdout, res.stdout + res.stderr


@pytest.mark.timeout(CASE_TIMEOUT_S + 30)  # the case's own deadline reports its output first
@pytest.mark.parametrize("block", _params())
def test_walk_through(block: Block):
    if not (ROOT / ".venv" / "bin" / "activate").exists():
        pytest.skip("no .venv: run `bash deploy/install.sh` first (the README's first step)")
    if "root" in block.marks and (os.geteuid() != 0 or shutil.which("ip") is None):
        pytest.skip("the emulated cluster needs root and iproute2")
    if "needs matplotlib" in block.marks and importlib.util.find_spec("matplotlib") is None:
        pytest.skip("needs the plot extra: pip install -e '.[plot]'")
    res = run_block(block.body)
    assert res.returncode == 0, (f"README walk-through {block.title!r} failed (exit {res.returncode}):\n"
                                 f"{block.body}\n--- stdout\n{res.stdout[-4000:]}\n--- stderr\n{res.stderr[-4000:]}")
