"""The environment variables: one per setting (``COMMRT_<SECTION>_<FIELD>``), the few that are
not settings, and which ``COMMRT_*`` names are nobody's (a misspelling such as
``COMMRT_COMM_BAKEND`` would otherwise be ignored without a word)."""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
from typing import Mapping

from commrt.runtime.config.render import toml_value
from commrt.runtime.config.tree import SECTION_TYPES

OTHER_VARIABLES = {
    "COMMRT_CONFIG": "path of the TOML config file",
    "COMMRT_JOB_SECRET": "the job secret of [security] mode = \"secret\" (`commrt launch` sets a fresh one per job)",
    "COMMRT_RESTART_COUNT": "set by `commrt launch --max-restarts` for its ranks: restarts so far",
    "COMMRT_EMULATED_NODE": "set by `commrt launch --emulate-network` for its ranks: the emulated node",
    "COMMRT_ELASTIC_GENERATION": "set by `commrt launch --nnodes MIN:MAX` for its ranks: the generation (0, 1, ...)",
    "COMMRT_ELASTIC_NODES": "set by `commrt launch --nnodes MIN:MAX` for its ranks: the generation's node ids, in rank order",
    "COMMRT_NODE_ID": "set by `commrt launch --nnodes MIN:MAX` for its ranks: this node's id (--node-rank)",
    "COMMRT_DEPLOY_WORKER_NODES": "`commrt node`: nodes that run workers (deploy/README.md)",
    "COMMRT_DEPLOY_NPROC": "`commrt node`: ranks per worker node",
    "COMMRT_DEPLOY_SERVERS": "`commrt node`: parameter-server shards",
    "COMMRT_DEPLOY_PS_PORT": "`commrt node`: the first shard's port",
    "COMMRT_DEPLOY_MIN_NODES": "`commrt node`: elastic when set: at least this many worker nodes (--nnodes MIN:W)",
    "COMMRT_DEPLOY_RDZV_TIMEOUT": "`commrt node`: an elastic job's --rdzv-timeout in seconds",
    "COMMRT_DEPLOY_K8S_SUBDOMAIN": "`commrt node k8s`: the workers' headless Service",
    "COMMRT_DEPLOY_K8S_JOB": "`commrt node k8s`: the workers' Job name",
    "COMMRT_DEPLOY_K8S_PS": "`commrt node k8s`: the shards' StatefulSet",
    "COMMRT_PS_PRINT_STATS": "workers.ps_train: worker 0 logs every server's counters at the end",
    "COMMRT_FT_STORE": "workers.train_lm with `fault_tolerance = \"replica\"`: the replicas' store (host:port, served outside the replicas)",
    "COMMRT_PYTHON": "deploy/slurm: the interpreter `node.sh` runs",
    "COMMRT_HOME": "deploy/slurm: the repository the sbatch script runs from (default: where it was submitted)",
    "COMMRT_TORCH": "install / Dockerfile: the torch requirement to install",
}
RESERVED_PREFIXES = ("COMMRT_TEST_",)  # the test suite's own switches


def env_var(section: str, name: str) -> str:
    return f"COMMRT_{section.upper()}_{name.upper()}"


def setting_variables() -> dict[str, tuple[str, str]]:
    """``COMMRT_<SECTION>_<FIELD>`` -> (section, field) for every setting."""
    return {env_var(s, f.name): (s, f.name) for s, cls in SECTION_TYPES.items() for f in dataclasses.fields(cls)}


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """``COMMRT_*`` names in ``environ`` that no setting and no part of commrt reads."""
    known = setting_variables().keys() | OTHER_VARIABLES.keys()
    return sorted(k for k in environ if k.startswith("COMMRT_") and k not in known
                  and not k.startswith(RESERVED_PREFIXES))


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string under it in the class body), read from the source."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def summary(cls: type, name: str) -> str:
    """The first sentence of a field's docstring, on one line."""
    text = " ".join(field_docs(cls).get(name, "").split()).replace("``", "`")  # RST literals as Markdown
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def env_table() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) for every setting, then the variables that are not settings:
    the README's table is ``commrt config --env-table``, made from this."""
    rows = []
    for section, cls in SECTION_TYPES.items():
        for f in dataclasses.fields(cls):
            rows.append((env_var(section, f.name), toml_value(f.default), f"[{section}] {f.name}: {summary(cls, f.name)}"))
    rows += [(var, "", meaning) for var, meaning in OTHER_VARIABLES.items()]
    return rows


def markdown_env_table() -> str:
    lines = ["| variable | default | setting |", "|---|---|---|"]
    for var, default, meaning in env_table():
        cell = f"`{default}`" if default else "—"
        lines.append(f"| `{var}` | {cell} | {meaning.replace('|', chr(92) + '|')} |")
    return "\n".join(lines)
