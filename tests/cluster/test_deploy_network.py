"""deploy/k8s: what each pod may reach (egress) and the audit witness's place, read from the
rendered manifests of every overlay as a CNI would apply them (docs/security.md "Who may
reach what").

A pod selected by an egress policy may reach only what one of those policies names; every
pod is selected by the namespace's default one (DNS and traces), so none has open egress.
"""

from __future__ import annotations

from typing import Any

import pytest

from clients.cli import build_parser
from tests.cluster.test_deploy import (
    OVERLAYS,
    WITNESS,
    _admitted_names,
    _env_of,
    _pod_labels,
    _selects,
    containers,
    ingress_policies,
    render,
)

EXECUTORS = ("executor-cpu", "executor-xla", "executor-cuda", "executor-tpu")
# Everyone: names (kube-dns) and traces (the OTLP collector, config.yaml).
COMMON = {("ns:kube-system", "53"), ("ns:observability", "4317")}
POSTGRES = ("cidr:0.0.0.0/0", "5432")
TEMPORAL = ("ns:temporal", "7233")


def _expected(name: str) -> set[tuple[str, str]]:
    """The (destination, port) pairs each pod needs, and no more."""
    executors = {(e, p) for e in EXECUTORS for p in ("grpc", "frames")}
    table = {
        "router": executors | {("metering", "grpc"), ("evaluator", "grpc")},
        "trial-worker": {(e, "grpc") for e in (*EXECUTORS, "metering", "evaluator")} | {TEMPORAL},
        "metering": {(WITNESS, "http"), POSTGRES},
        "switchyard-migrate": {POSTGRES},
        "evaluator": set(),
        WITNESS: set(),
    }
    if name.startswith("executor-"):
        return COMMON | {("metering", "grpc")}  # the refusals they audit
    return COMMON | table[name]


def _pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Every pod template's labels (Deployments, StatefulSets and the migrate Job), by name."""
    kinds = ("Deployment", "StatefulSet", "Job")
    return {d["metadata"]["name"]: _pod_labels(d) for d in docs if d["kind"] in kinds}


def _destinations(peer: dict[str, Any]) -> set[str]:
    if "ipBlock" in peer:
        assert not peer["ipBlock"].get("except"), peer
        return {f"cidr:{peer['ipBlock']['cidr']}"}
    if "namespaceSelector" in peer:  # another namespace (kube-system, temporal, observability)
        return {f"ns:{peer['namespaceSelector']['matchLabels']['kubernetes.io/metadata.name']}"}
    return _admitted_names(peer["podSelector"])


def _egress(docs: list[dict[str, Any]], labels: dict[str, str]) -> tuple[int, set[tuple[str, str]]]:
    """How many egress policies select the pod, and the union of what they allow."""
    policies = [
        p
        for p in docs
        if p["kind"] == "NetworkPolicy"
        and "Egress" in p["spec"]["policyTypes"]
        and _selects(p["spec"]["podSelector"], labels)
    ]
    allowed = set()
    for policy in policies:
        for rule in policy["spec"].get("egress", []):
            assert "to" in rule and "ports" in rule, (policy["metadata"]["name"], rule)  # no open rule
            for peer in rule["to"]:
                allowed |= {(d, str(p["port"])) for d in _destinations(peer) for p in rule["ports"]}
    return len(policies), allowed


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_reaches_only_what_it_needs(overlay: str) -> None:
    """Egress per pod is exactly its row of the table: the router cannot reach PostgreSQL or
    Temporal, executors only metering (their audits), the evaluator and the witness nothing
    but DNS and traces; only the worker reaches Temporal, only metering and the migrate Job
    reach PostgreSQL."""
    docs = render(overlay)
    pods = _pods(docs)
    assert {"router", "trial-worker", "metering", "switchyard-migrate", WITNESS, "evaluator"} <= set(pods)
    for name, labels in pods.items():
        count, allowed = _egress(docs, labels)
        assert count >= 1, f"{overlay}: no egress policy selects {name}: its egress is open"
        assert allowed == _expected(name), (overlay, name, allowed ^ _expected(name))
    reach_postgres = {n for n, lab in pods.items() if POSTGRES in _egress(docs, lab)[1]}
    reach_temporal = {n for n, lab in pods.items() if TEMPORAL in _egress(docs, lab)[1]}
    assert (reach_postgres, reach_temporal) == ({"metering", "switchyard-migrate"}, {"trial-worker"})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_ports_egress_names_are_ports_the_destination_pods_have(overlay: str) -> None:
    """A named port in an egress rule resolves against the destination's container ports: a
    typo would silently allow nothing, so each must exist on every pod it names."""
    docs = render(overlay)
    named_ports = {
        d["metadata"]["name"]: {p.get("name") for c in containers(d) for p in c.get("ports", [])}
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy" and "Egress" in d["spec"]["policyTypes"]):
        for rule in policy["spec"]["egress"]:
            names = [p["port"] for p in rule["ports"] if isinstance(p["port"], str)]
            for peer in rule["to"]:
                for pod in _destinations(peer) & set(named_ports):
                    assert set(names) <= named_ports[pod], (policy["metadata"]["name"], pod, names)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_witness_is_reached_by_metering_only_and_keeps_its_key_to_itself(overlay: str) -> None:
    """Its own pod, uid and volume; ingress from metering's pods only; metering given its
    address and its public key (from a ConfigMap the operator fills), never its volume."""
    docs = render(overlay)
    by_name = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    witness, metering = by_name[WITNESS], by_name["metering"]
    selecting = [
        p for p in ingress_policies(docs) if _selects(p["spec"]["podSelector"], _pod_labels(witness))
    ]
    assert selecting, "no ingress policy selects the witness"
    peers = [peer for p in selecting for rule in p["spec"]["ingress"] for peer in rule.get("from", [None])]
    assert None not in peers, "a rule admits every source to the witness"
    assert {n for peer in peers for n in _admitted_names(peer["podSelector"])} == {"metering"}
    uid = witness["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert uid != metering["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    volumes = {name: d["spec"]["template"]["spec"].get("volumes", []) for name, d in by_name.items()}
    claims = {
        name: {v["persistentVolumeClaim"]["claimName"] for v in vs if "persistentVolumeClaim" in v}
        for name, vs in volumes.items()
    }
    (store,) = claims[WITNESS]
    assert [n for n, c in claims.items() if store in c] == [WITNESS]
    (container,) = containers(metering)
    env = _env_of(container)
    assert env["SWITCHYARD_AUDIT_WITNESS"] == "http://witness:8209"
    assert env["SWITCHYARD_AUDIT_WITNESS_KEY"]["configMapKeyRef"] == {
        "name": "switchyard-witness-key",
        "key": "public",
    }
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert containers(witness)[0][probe]["httpGet"]["path"] == "/healthz"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_router_serves_tls_on_both_public_ports(overlay: str) -> None:
    """The router's public gRPC port and its OpenAI API both serve TLS with the certificate of
    a Secret mounted into the pod (the CLI's --tls-cert/--tls-key, which the real parser takes),
    and the Service exposes both."""
    docs = render(overlay)
    router = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "router")
    (container,) = containers(router)
    args = container["args"]
    parsed = build_parser().parse_args(args)
    assert (parsed.openai_port, bool(parsed.tls_cert), bool(parsed.tls_key)) == (8000, True, True), args
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in router["spec"]["template"]["spec"]["volumes"]}
    for path in (parsed.tls_cert, parsed.tls_key):
        folder, _, _ = path.rpartition("/")
        volume = volumes[mounts[folder]]
        assert volume["secret"]["secretName"] == "switchyard-router-public-tls", volume
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["openai"] == 8000
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "router")
    assert {p["port"] for p in service["spec"]["ports"]} >= {8001, 8000}
