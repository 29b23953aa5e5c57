"""The configs the README points users at load as written (issue 31.6): the parameter-server
cluster file of the walk-through, every ready-made file in docs/configs/, and the README's own
example config, each through the loader a job uses."""
import os
import pathlib
import re

import pytest

from commrt.runtime.config import load_config
from commrt.train.config import load_train_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "docs" / "configs").glob("*.toml"))


def _clean(monkeypatch):
    """The files alone: a COMMRT_* setting of the caller's shell must not mask what they say."""
    for name in [k for k in os.environ if k.startswith("COMMRT_")]:
        monkeypatch.delenv(name)


def test_ps_cluster_file_describes_two_shards_and_two_workers(monkeypatch):
    _clean(monkeypatch)
    cfg = load_config(str(ROOT / "docs" / "configs" / "ps_cluster.toml"))
    assert len(cfg.ps.servers) == 2 and len(set(cfg.ps.servers)) == 2
    assert all(s.startswith("tcp://127.0.0.1:") for s in cfg.ps.servers)
    assert cfg.ps.workers == 2 and cfg.ps.mode == "sync"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_docs_config_loads(path, monkeypatch):
    _clean(monkeypatch)
    load_config(str(path))        # every section checked, [train] included
    load_train_config(str(path))


def test_readme_links_every_docs_config():
    readme = (ROOT / "README.md").read_text()
    assert "(docs/configs/)" in readme
    assert "docs/configs/ps_cluster.toml" in readme


def test_readme_example_config_loads(tmp_path, monkeypatch):
    _clean(monkeypatch)
    readme = (ROOT / "README.md").read_text()
    fences = re.findall(r"```toml\n(.*?)```", readme, re.S)
    assert fences, "the README lost its example config"
    for i, text in enumerate(fences):
        path = tmp_path / f"example{i}.toml"
        path.write_text(text)
        load_config(str(path))
        load_train_config(str(path))
