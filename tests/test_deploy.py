"""deploy/, checked offline: no Docker engine or Kubernetes cluster runs here.

- The kustomize overlays (dev, prod) are rendered by ``kubectl kustomize`` (Debian's
  ``kubernetes-client``, or any newer kubectl; .ci/run installs it), and what they
  render is validated against the API's schemas (``kubernetes-validate``, strict:
  unknown fields are errors) and checked by a policy tool, checkov (PyPI), which
  .ci/run installs in a venv of its own.
- The compose file is validated against the Compose Specification's JSON schema, as
  vendored by ``check-jsonschema`` (``vendor/compose-spec.json``, from the
  compose-spec/compose-spec repository).
- The commands the image runs are run: the Dockerfile's ``pip install`` on a copy of
  what it COPYs, then its ENTRYPOINT; the workers' ``etcd-leases`` command lines are
  parsed by the real parser.

Without kubectl or checkov those tests skip, unless ``ETCD_LEASES_REQUIRE_DEPLOY_TOOLS``
is set (CI sets it): then they fail.
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
from etcd_leases.cli.connection import DEFAULT_COMMAND_TIMEOUT_S
from etcd_leases.cli.supervise import split_command

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "kubernetes" / "base"
MANIFESTS = sorted(path for path in BASE.glob("*.yaml") if path.name != "kustomization.yaml")
OVERLAYS = ["dev", "prod"]
REQUIRED = bool(os.environ.get("ETCD_LEASES_REQUIRE_DEPLOY_TOOLS"))
# etcd's write-ahead log beside the database: up to 5 files of 64 MiB, and room for
# snapshots; the quota plus this must fit the volume.
WAL_AND_SNAPSHOTS = 512 * 2**20


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str, docs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    if docs is None:
        docs = [doc for path in MANIFESTS for doc in documents(path)]
    return [doc for doc in docs if doc["kind"] == kind]


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    return loaded


def tool(name: str, variable: str) -> str:
    """The tool's path (``variable``, else on PATH); skip without it, unless required."""
    path = os.environ.get(variable) or shutil.which(name)
    if path is None:
        message = f"{name} not found (set {variable} or put it on PATH; .ci/run installs it)"
        if REQUIRED:
            pytest.fail(message)
        pytest.skip(message)
    return path


def render(overlay: str) -> str:
    """``kubectl kustomize`` of the overlay: the manifests it would apply."""
    kubectl = tool("kubectl", "ETCD_LEASES_KUBECTL")
    done = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "kubernetes" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def rendered(overlay: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(render(overlay)) if doc]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_kubernetes_manifests_match_the_api_schemas(path: Path) -> None:
    version = kubernetes_validate.latest_version()
    for doc in documents(path):
        kubernetes_validate.validate(doc, version, strict=True)
    # The validator does refuse what the API would (so the check above can fail).
    broken = copy.deepcopy(documents(path)[0])
    broken["spec"]["replicaz"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_renders_to_manifests_the_api_accepts(overlay: str) -> None:
    docs = rendered(overlay)
    version = kubernetes_validate.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    (namespace,) = by_kind("Namespace", docs)
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    kinds = sorted(doc["kind"] for doc in docs if doc["kind"] != "Namespace")
    assert kinds == sorted(doc["kind"] for path in MANIFESTS for doc in documents(path))
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == namespace["metadata"]["name"]
    (deployment,) = by_kind("Deployment", docs)
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.rsplit(":", 1)[1] not in ("", "latest")  # each overlay names its image


def test_prod_requires_members_and_candidates_on_different_nodes() -> None:
    for docs, wanted in ((rendered("prod"), "DoNotSchedule"), (rendered("dev"), "ScheduleAnyway")):
        for workload in (*by_kind("StatefulSet", docs), *by_kind("Deployment", docs)):
            spread = workload["spec"]["template"]["spec"]["topologySpreadConstraints"]
            by_key = {c["topologyKey"]: c["whenUnsatisfiable"] for c in spread}
            assert len(by_key) == len(spread) == 2  # patched, not added to
            assert by_key["kubernetes.io/hostname"] == wanted
            assert by_key["topology.kubernetes.io/zone"] == "ScheduleAnyway"


def quantity_bytes(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return int(text[:-2]) * units[text[-2:]] if text[-2:] in units else int(text)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_etcd_compacts_and_its_quota_fits_its_volume(overlay: str) -> None:
    (statefulset,) = by_kind("StatefulSet", rendered(overlay))
    (etcd,) = statefulset["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in etcd["env"]}
    assert env["ETCD_AUTO_COMPACTION_MODE"] == "periodic"
    assert env["ETCD_AUTO_COMPACTION_RETENTION"] == "5m"
    quota = int(env["ETCD_QUOTA_BACKEND_BYTES"])
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    volume = quantity_bytes(claim["spec"]["resources"]["requests"]["storage"])
    assert quota + WAL_AND_SNAPSHOTS <= volume, (quota, volume)
    # The data directory is on the volume.
    (mount,) = etcd["volumeMounts"]
    assert env["ETCD_DATA_DIR"].startswith(mount["mountPath"] + "/")


def pods(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    workloads = [*by_kind("StatefulSet", docs), *by_kind("Deployment", docs)]
    return [workload["spec"]["template"]["spec"] for workload in workloads]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_both_workloads_meet_the_restricted_pod_security_standard(overlay: str) -> None:
    """The profile's rules as Kubernetes states them (pod-security-standards,
    "Restricted"), on what is applied; the policy tool below checks them too."""
    specs = pods(rendered(overlay))
    assert len(specs) == 2
    for pod in specs:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            assert not pod.get(host)
        assert not pod.get("volumes")  # only the StatefulSet's claim: no hostPath
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"] == {"drop": ["ALL"]}
            assert context["readOnlyRootFilesystem"] is True
            assert not context.get("privileged")
            assert all("hostPort" not in port for port in container["ports"])


def checkov(directory: Path) -> dict[str, list[dict[str, Any]]]:
    """checkov's results on the Kubernetes manifests in ``directory`` (offline)."""
    command = [tool("checkov", "ETCD_LEASES_CHECKOV"), "--directory", str(directory)]
    command += ["--framework", "kubernetes", "--output", "json", "--skip-download"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip(), done.stderr
    results: dict[str, list[dict[str, Any]]] = json.loads(done.stdout)["results"]
    return results


# checkov's checks of the restricted profile, and the rest of what a cluster admin asks.
POLICY = {
    "CKV_K8S_16": "not privileged",
    "CKV_K8S_17": "no host PID namespace",
    "CKV_K8S_18": "no host IPC namespace",
    "CKV_K8S_19": "no host network",
    "CKV_K8S_20": "allowPrivilegeEscalation false",
    "CKV_K8S_22": "read-only root filesystem",
    "CKV_K8S_23": "not root",
    "CKV_K8S_25": "no added capabilities",
    "CKV_K8S_28": "no NET_RAW",
    "CKV_K8S_31": "seccomp RuntimeDefault",
    "CKV_K8S_37": "capabilities dropped",
    "CKV_K8S_38": "no service account token",
    "CKV_K8S_40": "a high UID",
    "CKV_K8S_8": "liveness probe",
    "CKV_K8S_9": "readiness probe",
}


def test_the_rendered_overlays_pass_the_policy_check(tmp_path: Path) -> None:
    """checkov, every Kubernetes check, on what each overlay renders; its exceptions
    are annotated on the workloads with their reasons. A copy of the worker that
    may escalate privileges and keeps its capabilities fails: the check can fail."""
    for overlay in OVERLAYS:
        (tmp_path / f"{overlay}.yaml").write_text(render(overlay))
    broken_dir = tmp_path / "broken"
    broken_dir.mkdir()
    (deployment,) = by_kind("Deployment", rendered("dev"))
    context = deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    context["allowPrivilegeEscalation"] = True
    del context["capabilities"]
    (broken_dir / "worker.yaml").write_text(yaml.safe_dump(deployment))

    results = checkov(tmp_path)
    failed = [
        (check["check_id"], check["resource"], check["file_path"])
        for check in results["failed_checks"]
    ]
    broken = {check_id for check_id, _, path in failed if "broken" in path}
    assert {"CKV_K8S_20", "CKV_K8S_37"} <= broken
    assert [entry for entry in failed if "broken" not in entry[2]] == []
    passed = {
        (check["check_id"], check["resource"])
        for check in results["passed_checks"]
        if "broken" not in check["file_path"]
    }
    for overlay in ("etcd-leases-dev", "etcd-leases"):
        for workload in ("StatefulSet.{}.etcd", "Deployment.{}.etcd-leases-worker"):
            for check_id in POLICY:
                assert (check_id, workload.format(overlay)) in passed, (check_id, workload)


def test_the_kubernetes_example_is_wired_together() -> None:
    (statefulset,) = by_kind("StatefulSet")
    (service,) = by_kind("Service")
    budgets = {b["metadata"]["name"]: b for b in by_kind("PodDisruptionBudget")}
    (deployment,) = by_kind("Deployment")
    assert statefulset["spec"]["replicas"] == 3
    assert service["spec"]["clusterIP"] == "None"
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"] == "etcd"
    assert budgets["etcd"]["spec"]["minAvailable"] == 2  # quorum of 3
    etcd_env = {
        e["name"]: e for e in statefulset["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    members = [f"etcd-{i}" for i in range(3)]
    assert etcd_env["ETCD_INITIAL_CLUSTER"]["value"] == ",".join(
        f"{m}=http://{m}.etcd:2380" for m in members
    )

    pod = deployment["spec"]["template"]["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    worker_budget = budgets["etcd-leases-worker"]
    assert worker_budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert worker_budget["spec"]["maxUnavailable"] == 1  # one candidate at a time
    (worker,) = pod["containers"]
    env = {e["name"]: e for e in worker["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["ETCDCTL_ENDPOINTS"]["value"] == ",".join(f"{m}.etcd:2379" for m in members)
    args = parse_worker(worker["args"])
    assert args.id == "$(POD_NAME)"  # the pod name, substituted by Kubernetes
    assert {"limits", "requests"} <= worker["resources"].keys()
    assert args.metrics_port == worker["ports"][0]["containerPort"]
    assert worker["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert worker["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    # SIGKILL must not come before the command's grace and the resignation are over
    # (the resignation: one etcd call, bounded by the command timeout).
    resign_s = DEFAULT_COMMAND_TIMEOUT_S
    assert pod["terminationGracePeriodSeconds"] >= args.grace + resign_s + 5
    # A lost leader's command stops within --grace: shorter than the TTL in which a
    # successor could not yet have taken over from a leader that died.
    assert args.grace < args.ttl / 1000
    # Liveness must not restart a leader still stopping its command in its grace.
    assert args.liveness_timeout > args.grace


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
