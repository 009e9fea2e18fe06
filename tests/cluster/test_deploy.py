"""deploy/: Dockerfiles pass hadolint, manifests render with `kubectl kustomize` and pass
`kubernetes-validate` strictly, and both say what the services actually need.

No container engine runs here, so images are linted and checked against the tree (every COPY
source exists), not built. `SWITCHYARD_KUBECTL=/path/a:/path/b` renders with further kubectl
binaries too (each must bundle kustomize v5: kubectl 1.27 or later).
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from clients.local_cluster.cluster_config import env_names
from tests.conftest import IN_CI, ROOT

DEPLOY = ROOT / "deploy"
DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))
OVERLAYS = ["base", "overlays/production", "overlays/gpu", "overlays/tpu"]
K8S_VERSION = kubernetes_validate.latest_version()
WITNESS = "witness"  # the audit witness: HTTP with signed answers, not a gRPC service


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        message = f"{name} not found; `make setup` installs it"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return found


def _kubectls() -> list[str]:
    extra = [p for p in os.environ.get("SWITCHYARD_KUBECTL", "").split(":") if p]
    return ["kubectl", *extra]


def render(overlay: str, kubectl: str = "kubectl") -> list[dict[str, Any]]:
    binary = _tool(kubectl) if kubectl == "kubectl" else kubectl
    return copy.deepcopy(_render(overlay, binary))


@functools.cache
def _render(overlay: str, binary: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [binary, "kustomize", str(DEPLOY / "k8s" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    # no deprecated kustomize fields (bases, patchesStrategicMerge, commonLabels, ...)
    assert "deprecated" not in proc.stderr + proc.stdout, proc.stderr + proc.stdout
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def workloads(docs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            yield doc


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return list(doc["spec"]["template"]["spec"]["containers"])


def test_every_environment_has_an_image() -> None:
    assert {p.name for p in DOCKERFILES} == {
        f"{n}.Dockerfile" for n in ("cpu", "cuda", "xla", "tpu", "control")
    }


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    proc = subprocess.run([_tool("hadolint"), str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_rejects_a_careless_dockerfile(tmp_path: Path) -> None:
    # The linter must be able to fail: unpinned base and packages, cache kept, running as root.
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nCMD python app.py\n")
    proc = subprocess.run([_tool("hadolint"), str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "DL3007" in proc.stdout and "DL3013" in proc.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_only_what_the_tree_has(dockerfile: Path) -> None:
    for line in dockerfile.read_text().splitlines():
        if not line.startswith("COPY ") or "--from=" in line:
            continue
        *sources, _dest = line.split()[1:]
        for src in sources:
            assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src} does not exist in the repository"


@pytest.mark.parametrize("kubectl", _kubectls())
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_render_and_validate(overlay: str, kubectl: str) -> None:
    docs = render(overlay, kubectl)
    assert docs
    for doc in docs:
        # strict: unknown fields (a typo in a probe, say) are errors, not silently dropped.
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_validator_rejects_a_broken_manifest() -> None:
    doc = render("base")[0]
    broken = {**doc, "spec": {"replicas": "three", "selector": {}, "template": {}}, "kind": "Deployment"}
    broken["apiVersion"] = "apps/v1"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_every_service_has_a_workload_with_grpc_probes() -> None:
    docs = render("base")
    names = {d["metadata"]["name"] for d in workloads(docs)}
    assert names >= {"router", "metering", "evaluator", "trial-worker", "executor-cpu", "executor-xla"}
    for doc in workloads(docs):
        if doc["metadata"]["name"] == WITNESS:
            continue  # HTTP, probed on /healthz (tests/cluster/test_deploy_network.py)
        for c in containers(doc):
            assert {"name": "switchyard-config"} in [e.get("configMapRef") for e in c.get("envFrom", [])]
            # probes go to the plaintext health-only port: the kubelet's gRPC probes show no
            # client certificate, and the service port requires one (docs/security.md)
            health_ports = [p["containerPort"] for p in c.get("ports", []) if p["name"] == "health"]
            for probe in ("startupProbe", "readinessProbe", "livenessProbe") if c.get("ports") else ():
                assert [c[probe]["grpc"]["port"]] == health_ports, (doc["metadata"]["name"], probe)
    # PostgreSQL and Temporal are external: nothing here runs them.
    images = [c["image"] for d in workloads(docs) for c in containers(d)]
    assert not [i for i in images if "postgres" in i or "temporal" in i]


def _resources(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    doc = next(d for d in workloads(docs) if d["metadata"]["name"] == name)
    return dict(containers(doc)[0]["resources"])


def test_accelerator_overlays_request_their_devices() -> None:
    gpu = render("overlays/gpu")
    assert _resources(gpu, "executor-cuda")["limits"]["nvidia.com/gpu"] == "1"
    tpu = render("overlays/tpu")
    assert _resources(tpu, "executor-tpu")["limits"]["google.com/tpu"] == "4"
    assert _resources(tpu, "executor-xla")["limits"]["google.com/tpu"] == "4"
    xla = next(d for d in workloads(tpu) if d["metadata"]["name"] == "executor-xla")
    assert {"name": "PJRT_DEVICE", "value": "TPU"} in containers(xla)[0]["env"]
    # The CPU-only base asks for no accelerator at all.
    for doc in workloads(render("base")):
        limits = containers(doc)[0].get("resources", {}).get("limits", {})
        assert not {"nvidia.com/gpu", "google.com/tpu"} & set(limits)


def test_production_overlay_is_namespaced_and_uses_the_registry() -> None:
    docs = render("overlays/production")
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "switchyard", doc["metadata"]["name"]
    for doc in workloads(docs):
        for c in containers(doc):
            assert c["image"].startswith("registry.example.com/switchyard/"), c["image"]


def _switchyard_vars(text: str) -> set[str]:
    return set(re.findall(r"\bSWITCHYARD_[A-Z0-9_]+\b", text))


def test_configured_environment_variables_are_read_by_something() -> None:
    # Each SWITCHYARD_* a manifest or the compose file sets must be a key of the cluster config
    # or a variable some service reads; otherwise it is configuration that does nothing.
    used = set()
    for path in [*DEPLOY.glob("k8s/**/*.yaml"), DEPLOY / "compose" / "compose.yaml"]:
        used |= _switchyard_vars(path.read_text())
    code = "".join(
        p.read_text()
        for d in ("switchyard", "services", "workflows", "clients")
        for p in (ROOT / d).rglob("*.py")
    )
    known = env_names() | _switchyard_vars(code)
    assert used - known == set()


def test_compose_file_is_consistent() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "temporal", "metering", "evaluator", "router", "worker", "executor-cpu"} <= set(
        services
    )
    for name, svc in services.items():
        for dep in svc.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown service {dep}"
        build = svc.get("build")
        if build:
            assert (DEPLOY / "compose" / build["context"] / build["dockerfile"]).exists(), name
    assert "SWITCHYARD_DATABASE_URL" in compose["x-switchyard-env"]
    from services.router import router_config

    routes = router_config.parse(tomllib.loads((DEPLOY / "compose" / "routes.toml").read_text()))
    hosts = {d.address.rsplit(":", 1)[0] for d in routes.deployments}
    assert hosts <= set(services), "a compose route points at a service that does not exist"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_routes_name_replicas_that_exist(overlay: str) -> None:
    # Each route deployment is one StatefulSet replica (name-N.service:port): N must be below
    # the replica count the overlay sets, and the port the executor's, or the route points at
    # nothing.
    docs = render(overlay)
    config_map = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("switchyard-routes")
    )
    routes = tomllib.loads(config_map["data"]["routes.toml"])
    sets = {d["metadata"]["name"]: d for d in workloads(docs) if d["kind"] == "StatefulSet"}
    for name, dep in routes["deployments"].items():
        host, port = dep["address"].rsplit(":", 1)
        pod, service = host.split(".", 1)
        workload, ordinal = pod.rsplit("-", 1)
        assert workload == service and workload in sets, f"{overlay}: {name} -> {dep['address']}"
        assert int(ordinal) < sets[workload]["spec"]["replicas"], f"{overlay}: {name} beyond the replicas"
        assert int(port) == containers(sets[workload])[0]["ports"][0]["containerPort"]
    used = {t for r in routes["routes"].values() for t in r["targets"]}
    used |= {c for r in routes["routes"].values() for c in r.get("shadow", {}).get("candidates", [])}
    assert used <= set(routes["deployments"])
    router = next(d for d in workloads(docs) if d["metadata"]["name"] == "router")
    volumes = router["spec"]["template"]["spec"]["volumes"]
    assert {"name": config_map["metadata"]["name"]} in [v.get("configMap") for v in volumes]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_routes_are_accepted_by_the_router(overlay: str) -> None:
    # The router's own validation (the one `router serve --config` runs at start-up).
    from services.router import router_config

    docs = render(overlay)
    config_map = next(d for d in docs if d["metadata"]["name"].startswith("switchyard-routes"))
    parsed = router_config.parse(tomllib.loads(config_map["data"]["routes.toml"]))
    assert {r.model for r in parsed.routes} == {"mlp", "tiny-lm", "minilm-l6"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_executor_replica_is_routed_and_every_route_has_a_replica(overlay: str) -> None:
    """Each replica of an executor StatefulSet is a deployment of the routes (so none is paid for
    and never sent work), and each deployment the routes name is a replica that exists."""
    import tomllib

    docs = render(overlay)
    (routes_map,) = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("switchyard-routes")
    ]
    routes = tomllib.loads(routes_map["data"]["routes.toml"])
    routed = set()
    for route in routes["routes"].values():
        routed |= {t if isinstance(t, str) else t["deployment"] for t in route["targets"]}
        for c in route.get("shadow", {}).get("candidates", []):
            routed.add(c if isinstance(c, str) else c["deployment"])
    routed_addresses = {routes["deployments"][name]["address"] for name in routed}
    replicas = set()
    for doc in workloads(docs):
        name = doc["metadata"]["name"]
        if doc["kind"] != "StatefulSet" or not name.startswith("executor-"):
            continue
        port = containers(doc)[0]["ports"][0]["containerPort"]
        replicas |= {f"{name}-{i}.{name}:{port}" for i in range(doc["spec"]["replicas"])}
    assert replicas == routed_addresses, replicas ^ routed_addresses


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_mounts_its_certificate(overlay: str) -> None:
    docs = render(overlay)
    config = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("switchyard-config")
    )
    tls_dir = config["data"]["SWITCHYARD_SECURITY_TLS_DIR"]
    assert "SWITCHYARD_SECURITY_INSECURE" not in config["data"]
    for doc in workloads(docs):
        if doc["kind"] == "Job" or doc["metadata"]["name"] == WITNESS:
            # the migration talks to the database only; the witness serves heads signed with
            # its own key, which metering checks (no certificate of a service vouches for it)
            continue
        spec = doc["spec"]["template"]["spec"]
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
        for c in containers(doc):
            mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
            assert mounts.get("tls") == tls_dir, doc["metadata"]["name"]
            assert secrets["tls"].startswith("switchyard-tls-"), doc["metadata"]["name"]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics for matchLabels and matchExpressions (In/NotIn/Exists)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, op = labels.get(expr["key"]), expr["operator"]
        if op == "In" and value not in expr["values"]:
            return False
        if op == "NotIn" and value in expr["values"]:
            return False
        if op == "Exists" and value is None:
            return False
        if op == "DoesNotExist" and value is not None:
            return False
    return True


def _admitted_names(selector: dict[str, Any]) -> set[str]:
    """The app.kubernetes.io/name values a pod selector can admit (it must pin that label)."""
    key = "app.kubernetes.io/name"
    if key in selector.get("matchLabels", {}):
        return {selector["matchLabels"][key]}
    exprs = [e for e in selector.get("matchExpressions", []) if e["key"] == key and e["operator"] == "In"]
    assert exprs, f"a selector that does not pin {key}: {selector}"
    return set(exprs[0]["values"])


def ingress_policies(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The NetworkPolicies that restrict ingress (the egress ones are test_deploy_network.py's)."""
    return [d for d in docs if d["kind"] == "NetworkPolicy" and "Ingress" in d["spec"]["policyTypes"]]


def _pod_labels(doc: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = doc["spec"]["template"]["metadata"].get("labels", {})
    return labels


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_internal_services_accept_only_router_and_worker_pods(overlay: str) -> None:
    """Every executor, metering and evaluator pod is selected by a NetworkPolicy whose ingress
    admits, from other pods, only the router and the trial worker (metering also an admin
    toolbox), apart from the metrics port; and the router and worker pods do carry those labels."""
    docs = render(overlay)
    pods = {d["metadata"]["name"]: _pod_labels(d) for d in workloads(docs) if "template" in d["spec"]}
    protected = {
        n: lab for n, lab in pods.items() if n.startswith("executor-") or n in ("metering", "evaluator")
    }
    assert {"metering", "evaluator", "executor-cpu", "executor-xla"} <= set(protected)
    callers = {pods["router"]["app.kubernetes.io/name"], pods["trial-worker"]["app.kubernetes.io/name"]}
    for name, labels in protected.items():
        selecting = [p for p in ingress_policies(docs) if _selects(p["spec"]["podSelector"], labels)]
        assert selecting, f"{overlay}: no NetworkPolicy selects {name}"
        for policy in selecting:
            assert "Ingress" in policy["spec"]["policyTypes"]
            for rule in policy["spec"].get("ingress", []):
                if "from" not in rule:  # any source: only the metrics port
                    assert [p["port"] for p in rule["ports"]] == [9090], (name, rule)
                    continue
                for peer in rule["from"]:
                    assert set(peer) == {"podSelector"}, (name, peer)  # no namespace or IP blocks
                    names = _admitted_names(peer["podSelector"])
                    executors = {n for n in names if n.startswith("executor-")}  # their audits
                    allowed = {"router", "trial-worker"} | (
                        {"switchyard-admin", *executors} if name == "metering" else set()
                    )
                    assert names <= allowed, (name, names)
                    assert callers <= names, name
    # a pod that is neither router nor worker (here: the evaluator calling an executor) is refused
    evaluator = pods["evaluator"]
    for name in ("executor-cpu", "metering"):
        rules = [
            r
            for p in ingress_policies(docs)
            if _selects(p["spec"]["podSelector"], protected[name])
            for r in p["spec"]["ingress"]
        ]
        assert not any(_selects(peer["podSelector"], evaluator) for r in rules for peer in r.get("from", []))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_executors_audit_their_refusals_to_metering(overlay: str) -> None:
    """Every executor is started with --metering (its refusals go to the audit trail, not only
    its log), and metering's NetworkPolicy lets its pods through."""
    docs = render(overlay)
    metering = {d["metadata"]["name"]: _pod_labels(d) for d in workloads(docs)}["metering"]
    ingress = [
        peer
        for p in ingress_policies(docs)
        if _selects(p["spec"]["podSelector"], metering)
        for rule in p["spec"]["ingress"]
        for peer in rule.get("from", [])
    ]
    executors = [d for d in workloads(docs) if d["metadata"]["name"].startswith("executor-")]
    assert executors
    for doc in executors:
        (container,) = [c for c in doc["spec"]["template"]["spec"]["containers"] if "executor" in c["args"]]
        args = container["args"]
        assert "--metering" in args, doc["metadata"]["name"]
        assert args[args.index("--metering") + 1] == "metering:8201"
        assert any(_selects(peer["podSelector"], _pod_labels(doc)) for peer in ingress), doc["metadata"][
            "name"
        ]
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    for name, svc in compose["services"].items():
        if name.startswith("executor-"):
            command = svc["command"]
            assert command[command.index("--metering") + 1] == "metering:8201", name


def _env_of(container: dict[str, Any]) -> dict[str, Any]:
    env: list[dict[str, Any]] = container.get("env", [])
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in env}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ledger_integrity_is_wired(overlay: str) -> None:
    """docs/ledger-integrity.md on Kubernetes: every metering replica reads one audit key from a
    mounted Secret (not a key each pod would make for itself), writes the signed head digest to a
    volume the replicas share, and connects as the runtime role; the migration runs as the
    schema's owner and names the runtime role whose grants it resets."""
    docs = render(overlay)
    (metering,) = [d for d in workloads(docs) if d["metadata"]["name"] == "metering"]
    spec = metering["spec"]["template"]["spec"]
    (container,) = containers(metering)
    env = _env_of(container)
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}

    def volume_holding(path: str) -> dict[str, Any]:
        (name,) = [n for n, m in mounts.items() if path.startswith(m["mountPath"].rstrip("/") + "/")]
        volume: dict[str, Any] = volumes[name]
        return volume

    key_volume = volume_holding(env["SWITCHYARD_AUDIT_KEY_FILE"])
    assert key_volume["secret"]["secretName"] == "switchyard-audit-key"
    assert env["SWITCHYARD_AUDIT_KEY_FILE"].rsplit("/", 1)[1] == "key"  # the Secret's key
    assert "SWITCHYARD_AUDIT_KEY" not in env  # the key itself never sits in a manifest
    anchor_volume = volume_holding(env["SWITCHYARD_AUDIT_ANCHOR"])
    claim = anchor_volume["persistentVolumeClaim"]["claimName"]
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == claim]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # shared by the replicas
    assert not mounts[next(n for n, v in volumes.items() if v is anchor_volume)].get("readOnly")
    assert env["SWITCHYARD_DATABASE_URL"] == {"secretKeyRef": {"name": "switchyard-database", "key": "url"}}

    (migrate,) = [d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == "switchyard-migrate"]
    (job,) = migrate["spec"]["template"]["spec"]["containers"]
    job_env = _env_of(job)
    assert job["args"][:2] == ["metering", "migrate"]
    assert job_env["SWITCHYARD_DATABASE_URL"] == {
        "secretKeyRef": {"name": "switchyard-database", "key": "migrator-url"}
    }
    assert job_env["SWITCHYARD_DATABASE_RUNTIME_ROLE"] == {
        "secretKeyRef": {"name": "switchyard-database", "key": "runtime-role"}
    }
    # what the manifests name is what the service reads
    from services.metering import auditkey, db

    assert {auditkey.ENV_KEY_FILE, auditkey.ENV_ANCHOR} <= set(env)
    assert db.ENV_RUNTIME_ROLE in job_env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_worker_dials_temporal_over_mtls_and_seals_payloads(overlay: str) -> None:
    """The worker reaches the Temporal cluster with TLS (its CA and a client certificate from a
    mounted Secret, the frontend's name checked) and reads the payload codec's keys from another
    Secret; the names are those workflows/temporal_link.py reads."""
    from workflows import temporal_codec, temporal_link

    docs = render(overlay)
    (worker,) = [d for d in workloads(docs) if d["metadata"]["name"] == "trial-worker"]
    spec = worker["spec"]["template"]["spec"]
    (container,) = containers(worker)
    env = _env_of(container)
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}

    def secret_holding(path: str) -> dict[str, Any]:
        folder, _, _ = path.rpartition("/")
        volume = volumes[mounts[folder]]
        assert volume["secret"]["defaultMode"] == 0o400, path
        secret: dict[str, Any] = volume["secret"]
        return secret

    for name in (temporal_link.CA_ENV, temporal_link.CERT_ENV, temporal_link.KEY_ENV):
        assert secret_holding(env[name])["secretName"] == "switchyard-temporal-tls", name
    assert [env[n].rsplit("/", 1)[1] for n in (temporal_link.CA_ENV, temporal_link.CERT_ENV)] == [
        "ca.crt",
        "tls.crt",
    ]
    config = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("switchyard-config")
    )
    frontend = config["data"]["SWITCHYARD_TEMPORAL"].rsplit(":", 1)[0]
    assert env[temporal_link.SERVER_NAME_ENV] == frontend
    assert secret_holding(env[temporal_codec.KEY_FILE_ENV])["secretName"] == "switchyard-temporal-codec"
    tls = temporal_link.TemporalTLS.from_env({k: v for k, v in env.items() if isinstance(v, str)})
    assert tls.enabled and tls.cert_file and tls.server_name == frontend
