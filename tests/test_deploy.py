"""deploy/, checked offline: no Docker engine or Kubernetes cluster runs here.

- The Kubernetes manifests are validated against the API's schemas
  (``kubernetes-validate``, strict: unknown fields are errors).
- The compose file is validated against the Compose Specification's JSON schema, as
  vendored by ``check-jsonschema`` (``vendor/compose-spec.json``, from the
  compose-spec/compose-spec repository).
- The commands the image runs are run: the Dockerfile's ``pip install`` on a copy of
  what it COPYs, then its ENTRYPOINT; the workers' ``etcd-leases`` command lines are
  parsed by the real parser.
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from etcd_leases.cli import parser
from etcd_leases.cli.supervise import split_command

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in documents(path) if doc["kind"] == kind]


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    return loaded


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_kubernetes_manifests_match_the_api_schemas(path: Path) -> None:
    version = kubernetes_validate.latest_version()
    for doc in documents(path):
        kubernetes_validate.validate(doc, version, strict=True)
    # The validator does refuse what the API would (so the check above can fail).
    broken = copy.deepcopy(documents(path)[-1])
    broken["spec"]["replicaz"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_the_kubernetes_example_is_wired_together() -> None:
    (statefulset,) = by_kind("StatefulSet")
    (service,) = by_kind("Service")
    (budget,) = by_kind("PodDisruptionBudget")
    (deployment,) = by_kind("Deployment")
    assert statefulset["spec"]["replicas"] == 3
    assert service["spec"]["clusterIP"] == "None"
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"] == "etcd"
    assert budget["spec"]["minAvailable"] == 2  # quorum of 3
    etcd_env = {
        e["name"]: e for e in statefulset["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    members = [f"etcd-{i}" for i in range(3)]
    assert etcd_env["ETCD_INITIAL_CLUSTER"]["value"] == ",".join(
        f"{m}=http://{m}.etcd:2380" for m in members
    )

    pod = deployment["spec"]["template"]["spec"]
    (worker,) = pod["containers"]
    env = {e["name"]: e for e in worker["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["ETCDCTL_ENDPOINTS"]["value"] == ",".join(f"{m}.etcd:2379" for m in members)
    args = parse_worker(worker["args"])
    assert args.id == "$(POD_NAME)"  # the pod name, substituted by Kubernetes
    assert {"limits", "requests"} <= worker["resources"].keys()
    assert worker["livenessProbe"]["httpGet"]["port"] == "metrics"
    assert args.metrics_port == worker["ports"][0]["containerPort"]
    # SIGKILL must not come before the command's grace and the resignation are over.
    assert pod["terminationGracePeriodSeconds"] >= args.grace + 10


def parse_worker(command: list[str]) -> Any:
    """The worker's command line, parsed by etcd-leases itself."""
    flags, supervised = split_command(command)
    assert supervised, "elect needs a command after --"
    return parser().parse_args(flags)


def test_the_compose_file_matches_the_compose_specification() -> None:
    vendored = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads(vendored.joinpath("compose-spec.json").read_text())
    jsonschema.validate(compose(), schema)
    broken = compose()
    broken["services"]["worker1"]["stop_grace_periodd"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_compose_runs_three_workers_electing_over_three_etcd_members() -> None:
    services = compose()["services"]
    etcds = sorted(name for name in services if name.startswith("etcd"))
    workers = sorted(name for name in services if name.startswith("worker"))
    assert (etcds, workers) == (["etcd1", "etcd2", "etcd3"], ["worker1", "worker2", "worker3"])
    for name in workers:
        worker = services[name]
        args = parse_worker(worker["command"])
        assert args.handler.__name__ == "_elect" and args.name == "reports"
        assert worker["environment"]["ETCDCTL_ENDPOINTS"] == "etcd1:2379,etcd2:2379,etcd3:2379"
        assert int(worker["stop_grace_period"].rstrip("s")) >= args.grace + 10


def dockerfile() -> list[tuple[str, str]]:
    instructions = []
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            instructions.append((word.upper(), rest.strip()))
    return instructions


def test_the_image_installs_the_package_and_runs_the_command(tmp_path: Path) -> None:
    context = tmp_path / "context"
    context.mkdir()
    target = tmp_path / "image"
    entrypoint: list[str] = []
    for word, rest in dockerfile():
        if word == "COPY":
            *sources, _ = shlex.split(rest)
            for source in sources:  # what the image gets, and nothing else
                if (ROOT / source).is_dir():
                    shutil.copytree(ROOT / source, context / source)
                else:
                    shutil.copy(ROOT / source, context / source)
        elif word == "RUN":
            command = shlex.split(rest)
            assert command[:2] == ["pip", "install"], rest
            # Into a directory instead of a venv; dependencies come from ours.
            install = [sys.executable, "-m", "pip", *command[1:], "--no-deps"]
            install += ["--no-build-isolation", "--target", str(target), "--quiet"]
            done = subprocess.run(install, cwd=context, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
        elif word in ("ENTRYPOINT", "CMD"):
            entrypoint += json.loads(rest)
    assert entrypoint == ["etcd-leases", "--help"]

    env = {**os.environ, "PYTHONPATH": str(target)}
    script = target / "bin" / entrypoint[0]
    done = subprocess.run(
        [str(script), *entrypoint[1:]], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: etcd-leases")
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import etcd_leases.cli, prometheus_client; print(etcd_leases.__file__)",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert where.stdout.strip() == str(target / "etcd_leases" / "__init__.py")
    assert (target / "etcd_leases" / "py.typed").exists()
    assert list((target / "etcd_leases" / "etcd" / "wire").glob("*.proto"))
