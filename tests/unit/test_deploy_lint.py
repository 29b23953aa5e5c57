"""The deploy recipes pass the standard linters and agree with the scheduler mapping: shellcheck
on every script, hadolint on the Dockerfile, every Kubernetes object validated (strictly) against
the Kubernetes OpenAPI schema shipped offline by kubernetes-validate, and the manifests' own
numbers (completions, replicas, names) fed through commrt.deploy.plan.k8s_plan. The linters come
with the ``test`` extra; a venv without them skips those checks, saying so."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from commrt.deploy.plan import k8s_plan

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
SCRIPTS = sorted([*DEPLOY.rglob("*.sh"), *DEPLOY.rglob("*.sbatch")])
MANIFESTS = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")
K8S_VERSION = "1.30.0"  # the oldest release the recipes promise (Indexed Jobs, pod-index labels)


def _tool(name: str) -> str:
    found = shutil.which(name, path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if not found:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return found


def _docs(path: pathlib.Path) -> list[dict]:
    yaml = pytest.importorskip("yaml")
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_shellcheck_passes_on_every_script():
    assert {p.name for p in SCRIPTS} >= {"install.sh", "node.sh", "commrt.sbatch"}
    proc = subprocess.run([_tool("shellcheck"), "--shell=bash", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(os.access(p, os.X_OK) for p in SCRIPTS if p.name != "install.sh")


def test_hadolint_passes_on_the_dockerfile():
    proc = subprocess.run([_tool("hadolint"), "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_shape():
    """What the issue asks of the image (hadolint checks style, not these)."""
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines[0].startswith("ARG BASE=") and "FROM ${BASE}" in lines
    assert 'ARG COMMRT_TORCH="torch==2.13.0"' in lines
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert lines[-2] == 'ENTRYPOINT ["commrt"]'


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_every_kubernetes_object_matches_the_schema(path):
    kv = pytest.importorskip("kubernetes_validate")
    for doc in _docs(path):
        kv.validate(doc, K8S_VERSION, strict=True)


def test_kustomizations_name_files_that_exist():
    for kust in K8S.rglob("kustomization.yaml"):
        (doc,) = _docs(kust)
        for entry in doc.get("resources", []) + [p["path"] for p in doc.get("patches", [])]:
            assert (kust.parent / entry).exists(), f"{kust}: {entry} does not exist"


def _objects() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for p in MANIFESTS for d in _docs(p)
            if p.name != "workers-patch.yaml"}


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def test_no_secret_is_committed_and_pods_run_unprivileged_with_requests():
    objs = _objects()
    assert not [k for k in objs if k[0] == "Secret"], "the Secret is made by `kubectl create secret` (README)"
    for kind, name in [("Job", "trainer"), ("StatefulSet", "commrt-ps")]:
        pod = objs[(kind, name)]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"]:
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
        keys = [v for v in pod["volumes"] if v["name"] == "keys"]
        assert keys[0]["secret"]["secretName"] == "commrt-keys"
    probe = objs[("StatefulSet", "commrt-ps")]["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]
    assert probe["exec"]["command"] == ["commrt", "server-status"]


def test_the_manifests_numbers_and_names_map_to_one_job():
    """A worker pod and a server pod, with the variables the manifests and Kubernetes give them,
    must agree on the node count, node 0's DNS name and the shards' addresses."""
    objs = _objects()
    job, sts = objs[("Job", "trainer")], objs[("StatefulSet", "commrt-ps")]
    (patch,) = _docs(K8S / "ps" / "workers-patch.yaml")
    pod = job["spec"]["template"]["spec"]
    wenv = {**_env(pod["containers"][0]), **_env(patch["spec"]["template"]["spec"]["containers"][0])}
    senv = _env(sts["spec"]["template"]["spec"]["containers"][0])
    nodes = int(wenv["COMMRT_DEPLOY_WORKER_NODES"])
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == nodes
    assert job["spec"]["completionMode"] == "Indexed"
    service = objs[("Service", pod["subdomain"])]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"job-name": "trainer"}
    assert objs[("Service", sts["spec"]["serviceName"])]["spec"]["clusterIP"] == "None"
    last = k8s_plan({**wenv, "JOB_COMPLETION_INDEX": str(nodes - 1), "HOSTNAME": f"trainer-{nodes - 1}"}, "worker")
    shard = k8s_plan({**senv, "HOSTNAME": f"{sts['metadata']['name']}-{sts['spec']['replicas'] - 1}"}, "server")
    assert last.master_addr == f"trainer-0.{pod['subdomain']}"
    assert last.servers == shard.servers and len(shard.servers) == sts["spec"]["replicas"]
    assert last.environ()["COMMRT_PS_WORKERS"] == shard.environ()["COMMRT_PS_WORKERS"]
    assert all(s.endswith(f".{sts['spec']['serviceName']}:29600") for s in shard.servers)
