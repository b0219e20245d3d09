"""deploy/k8s: the kustomize manifests rendered with ``kubectl kustomize`` (offline; skipped
without kubectl) and the Secrets ``make-secrets.sh`` prints, checked against kiln's own settings,
ports, health service names, NATS users and PKI. Nothing here talks to a cluster."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from pydantic_settings import BaseSettings

from kiln.common.server import LIVENESS, READINESS
from kiln.common.settings import SERVICE_NAMES, KilnSettings, ServiceName, split_host_port
from kiln.embedded.nats_auth import NATS_USERS, compose_config, password_variable
from tests.unit.test_deploy_images import compose_images

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")
KILN_IMAGES = {"kiln", "kiln-engine", "kiln-engine-cpu"}


def render(path: Path) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(path)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed")
    return render(K8S / "base")


@pytest.fixture(scope="module")
def trial() -> list[dict[str, Any]]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed")
    return render(K8S / "overlays" / "trial")


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
            yield f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]["spec"]


def kiln_containers(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for where, spec in pod_specs(docs):
        for c in spec["containers"] + spec.get("initContainers", []):
            if c["image"].split(":")[0] in KILN_IMAGES:
                yield where, c


def default_ports(service: ServiceName) -> tuple[int, int]:
    """The gRPC and metrics ports kiln gives ``service`` when nothing is configured."""
    field = KilnSettings.model_fields[service.replace("-", "_") + "_addr"]
    grpc_port = split_host_port(str(field.default))[1]
    metrics = KilnSettings.model_construct(metrics_port=None).service_metrics_port(service)
    return grpc_port, metrics


def kiln_setting_names() -> set[str]:
    """Every environment variable a kiln pydantic-settings class reads: its env prefix plus each
    field's name in upper case, or the field's validation alias."""
    root = REPO / "services"
    for path in root.rglob("*.py"):
        if "BaseSettings" in path.read_text(errors="replace"):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            importlib.import_module(module)
    names: set[str] = set()
    pending: list[type] = list(BaseSettings.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if not cls.__module__.startswith("kiln."):
            continue
        prefix = str(cls.model_config.get("env_prefix", ""))
        for name, field in cls.model_fields.items():
            alias = field.validation_alias
            names.add(alias if isinstance(alias, str) else (prefix + name).upper())
    return names


def env_of(container: dict[str, Any], docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Name -> value (or valueFrom) of every variable ``container`` gets, envFrom included."""
    env: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef") or source.get("secretRef")
        kind = "ConfigMap" if "configMapRef" in source else "Secret"
        env.update(find(docs, kind, ref["name"]).get("data", {}))
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", var.get("valueFrom"))
    return env


# --- the services -----------------------------------------------------------------------------
@needs_kubectl
def test_every_service_has_a_deployment_and_a_service_on_kilns_ports(base: list) -> None:
    for service in SERVICE_NAMES:
        grpc_port, metrics_port = default_ports(service)
        svc = find(base, "Service", service)
        ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
        assert ports == {"grpc": grpc_port, "metrics": metrics_port}, service
        deployment = find(base, "Deployment", service)
        template = deployment["spec"]["template"]
        assert svc["spec"]["selector"].items() <= template["metadata"]["labels"].items()
        (c,) = template["spec"]["containers"]
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == ports, service
        assert c["args"][:2] == ["serve", service]
        env = env_of(c, base)
        assert split_host_port(env["KILN_LISTEN_ADDR"]) == ("0.0.0.0", grpc_port)
        assert "KILN_METRICS_PORT" not in env, "each service keeps its own default metrics port"
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(metrics_port)
        # The address clients dial is the Service's name and port, which the certificate names.
        assert split_host_port(env[f"KILN_{service.replace('-', '_').upper()}_ADDR"]) == (
            service,
            grpc_port,
        )


@needs_kubectl
def test_every_env_var_is_a_kiln_setting(base: list, trial: list) -> None:
    known = kiln_setting_names()
    assert {"KILN_NATS_URL", "KILN_ENGINE_DEVICES", "KILN_RUNNER_EXPERIMENT_DEADLINE_S"} <= known
    for docs in (base, trial):
        for where, c in kiln_containers(docs):
            unknown = {n for n in env_of(c, docs) if n.startswith("KILN_")} - known
            assert not unknown, f"{where}: not kiln settings: {sorted(unknown)}"
        for d in docs:
            if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kiln-config"):
                assert set(d["data"]) <= known


@needs_kubectl
def test_probes_ask_the_grpc_health_service_with_the_services_certificate(base: list) -> None:
    for service in SERVICE_NAMES:
        grpc_port, _ = default_ports(service)
        (c,) = find(base, "Deployment", service)["spec"]["template"]["spec"]["containers"]
        for probe, health_name in (
            ("startupProbe", LIVENESS),
            ("livenessProbe", LIVENESS),
            ("readinessProbe", READINESS),
        ):
            command = c[probe]["exec"]["command"]
            assert command[:3] == ["kiln", "health", f"127.0.0.1:{grpc_port}"], (service, probe)
            assert command[command.index("--service") + 1] == health_name, (service, probe)
            assert c[probe]["timeoutSeconds"] >= 5, "a probe starts a Python process"
        env = env_of(c, base)
        assert env["KILN_TLS"] == "on" and env["KILN_TLS_CERT_FILE"].startswith("/tls/")
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounts["/tls"] == "tls"


@needs_kubectl
def test_the_engine_pool_is_a_gpu_workload_of_the_engine_image(base: list) -> None:
    spec = find(base, "Deployment", "engine-pool")["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert spec.get("nodeSelector") or spec.get("affinity")
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    assert env_of(c, base)["KILN_ENGINE_DEVICES"] == "auto"
    assert c["image"].split(":")[0] == "kiln-engine"


@needs_kubectl
def test_images_are_the_ones_the_dockerfiles_build(base: list) -> None:
    built = compose_images()
    for where, c in kiln_containers(base):
        name, _, tag = c["image"].partition(":")
        assert name in built and tag, f"{where}: {c['image']}"
        if where == "Deployment/engine-pool":
            assert built[name][0] == "Dockerfile.engine"
        else:
            assert built[name] == ("Dockerfile", "services"), where


@needs_kubectl
def test_replicas_follow_the_design(base: list) -> None:
    runner = find(base, "Deployment", "agent-runner")["spec"]
    assert runner["replicas"] == 1, "one agent runner per ledger (kiln.agent_runner.app)"
    assert runner["strategy"]["type"] == "Recreate", "a rollout must not run two at once"
    assert find(base, "Deployment", "ledger")["spec"]["replicas"] >= 2
    assert find(base, "Deployment", "cost-model")["spec"]["replicas"] >= 2


@needs_kubectl
def test_pods_run_as_non_root_with_resources(base: list, trial: list) -> None:
    for where, spec in pod_specs(trial):
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"].get("runAsUser", 1) != 0, where
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, where
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], where
            assert c["resources"]["requests"]["memory"] and c["resources"]["limits"]["memory"]


@needs_kubectl
def test_nats_runs_kilns_users_from_the_generated_configuration(base: list) -> None:
    assert (K8S / "base" / "nats-server.conf").read_text() == compose_config(), (
        "cp deploy/nats/nats-server.conf deploy/k8s/base/nats-server.conf"
    )
    (c,) = find(base, "StatefulSet", "nats")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
    assert env == {password_variable(u): {"name": "kiln-nats", "key": u} for u in NATS_USERS}
    assert "-js" in c["args"]
    for service in SERVICE_NAMES:
        (kc,) = find(base, "Deployment", service)["spec"]["template"]["spec"]["containers"]
        assert env_of(kc, base)["KILN_NATS_USER"] == service


# --- Secrets ----------------------------------------------------------------------------------
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|API_KEY|DATABASE_URL|DSN", re.IGNORECASE)


@needs_kubectl
def test_no_secret_is_committed(base: list, trial: list) -> None:
    for docs in (base, trial):
        assert not [d for d in docs if d["kind"] == "Secret"], "Secrets come from make-secrets.sh"
        for where, spec in pod_specs(docs):
            for c in spec["containers"]:
                for var in c.get("env", []):
                    if SECRET_NAME.search(var["name"]) and not var["name"].endswith("_FILE"):
                        assert "valueFrom" in var, f"{where}: {var['name']} in plain text"
    for path in (REPO / "deploy").rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace")
            assert "PRIVATE KEY-----" not in text, path
            for password in re.findall(r"postgresql\+?\w*://[^:@\s/]+:([^@\s]+)@", text):
                placeholder = re.fullmatch(r"[A-Z_]+|\$\S+", password)  # USER:PASSWORD, $VAR
                assert placeholder, f"{path}: a database password in plain text"


def referenced_secrets(docs: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Secret name -> the keys the pods read from it (env, envFrom, volumes)."""
    refs: dict[str, set[str]] = {}
    for _, spec in pod_specs(docs):
        for c in spec["containers"]:
            for var in c.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.setdefault(ref["name"], set()).add(ref["key"])
        for volume in spec.get("volumes", []):
            secret = volume.get("secret")
            if secret:
                keys = {i["key"] for i in secret.get("items", [])}
                refs.setdefault(secret["secretName"], set()).update(keys or {"*"})
    return refs


@pytest.fixture(scope="module")
def made_secrets(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed")
    pki_dir = tmp_path_factory.mktemp("k8s-pki")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    out = subprocess.run(
        ["bash", str(K8S / "make-secrets.sh"), "--pki", str(pki_dir / "pki"), "--trial"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=120,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@needs_kubectl
def test_make_secrets_provides_every_secret_the_pods_read(trial: list, made_secrets: list) -> None:
    import base64

    made = {d["metadata"]["name"]: d["data"] for d in made_secrets if d["kind"] == "Secret"}
    for name, keys in referenced_secrets(trial).items():
        assert name in made, f"make-secrets.sh makes no Secret {name}"
        assert keys == {"*"} or keys <= set(made[name]), (name, keys - set(made[name]))
    url = base64.b64decode(made["kiln-database"]["url"]).decode()
    host, port = split_host_port(url.rsplit("@", 1)[1].split("/", 1)[0])
    pg = find(trial, "Service", "postgres")
    assert (host, port) == ("postgres", pg["spec"]["ports"][0]["port"])
    for service in SERVICE_NAMES:
        data = made[f"kiln-tls-{service}"]
        assert set(data) == {"ca.pem", "cert.pem", "key.pem"}
        cert = x509.load_pem_x509_certificate(base64.b64decode(data["cert.pem"]))
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
            f"spiffe://kiln/service/{service}"
        ]
        # Clients dial the Service by name: the certificate must be valid for it.
        assert service in san.get_values_for_type(x509.DNSName)
    assert "ca.key" not in (REPO / "deploy" / "k8s" / "make-secrets.sh").read_text()


def test_every_namespaced_object_is_in_kilns_namespace(base: list, trial: list) -> None:
    """``kubectl apply -k`` without ``-n`` puts nothing in the context's namespace."""
    for objects in (base, trial):
        stray = [
            (o["kind"], o["metadata"]["name"])
            for o in objects
            if o["kind"] != "Namespace" and o["metadata"].get("namespace") != "kiln"
        ]
        assert not stray, stray
