"""Router building blocks on their own: wire edits, config validation, policies, auth cache.

These use the real code paths with in-memory fakes for the one port each needs; the
integration tests (test_router_*.py) run the same code against real executors and metering.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
import tomllib
from collections import Counter
from pathlib import Path

import grpc
import pytest

from clients.local_cluster.local_routes import render_routes
from clients.local_cluster.plan import ServiceSpec
from services.router import router_config as config
from services.router import wire, wire_write
from services.router.auth import Authenticator, Identity, authorize, bearer_key
from services.router.policies import DeploymentState, plan
from services.router.route_store import Change, RouteChange, RouteStore
from services.router.router_config import Deployment, Policy, Route, Settings, Target, route_table
from switchyard.errors import InvalidArgument, PermissionDenied, Unauthenticated, Unavailable
from switchyard.gen.inference import grpc_service_pb2 as pb


def _request() -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="mlp", model_version="", id="caller-7")
    req.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    req.raw_input_contents.append(bytes(range(16)))
    req.parameters["priority"].int64_param = 3
    return req


def test_header_read_without_decoding_and_appended_fields_override() -> None:
    req = _request()
    raw = req.SerializeToString()
    assert wire.read_header(raw) == wire.Header("mlp", "", "caller-7")
    name = wire_write.string_field(wire.MODEL_NAME, "mlp-b")
    edited = raw + name + wire_write.string_field(wire.MODEL_VERSION, "2")
    decoded = pb.ModelInferRequest.FromString(edited)
    assert (decoded.model_name, decoded.model_version, decoded.id) == ("mlp-b", "2", "caller-7")
    assert decoded.raw_input_contents[0] == bytes(range(16))  # tensor bytes untouched
    assert wire.read_header(edited).model_name == "mlp-b"


def test_parameters_appended_to_a_response_and_read_back() -> None:
    resp = pb.ModelInferResponse(model_name="mlp")
    resp.parameters["compute_us"].int64_param = 120
    resp.parameters["backend"].string_param = "cpu"
    resp.raw_output_contents.append(b"\x00" * 64)
    raw = resp.SerializeToString() + wire_write.parameters_field(
        {"path": "cpu-eager", "router_overhead_us": 42, "backend": "override", "neg": -5, "f": 0.5, "b": True}
    )
    params = wire.read_parameters(raw)
    assert params["compute_us"] == 120 and params["path"] == "cpu-eager"
    assert params["router_overhead_us"] == 42 and params["neg"] == -5 and params["f"] == 0.5
    assert params["backend"] == "override" and params["b"] is True
    assert pb.ModelInferResponse.FromString(raw).raw_output_contents[0] == b"\x00" * 64


def test_a_string_parameter_is_encoded_as_the_map_encodes_it() -> None:
    for key, value in ((b"request_id", "0" * 32), (b"k", ""), (b"path", "é" * 40), (b"id", "x" * 300)):
        assert wire_write.string_parameter(key, value) == wire_write.parameters_field({key.decode(): value})
    head = pb.ModelInferResponse(model_name="mlp").SerializeToString()
    raw = head + wire_write.string_parameter(b"request_id", "r1")
    assert wire.read_parameters(raw) == {"request_id": "r1"}


def test_the_parameters_sent_to_an_executor_carry_the_deadline_and_what_is_asked() -> None:
    from services.router.executor_transport import request_parameters

    def sent(timeout_s: float, unary: bool) -> dict[str, wire.Param]:
        head = pb.ModelInferRequest(model_name="mlp").SerializeToString()
        return wire.read_parameters(head + request_parameters(timeout_s, unary, False))

    assert sent(1.5, True) == {"timeout": 1_500_000, "switchyard_unary": True, "switchyard_stats": True}
    assert sent(0.0, False) == {"timeout": 1}


def test_malformed_request_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument):
        wire.read_header(b"\x0a\xff")  # length runs past the end
    with pytest.raises(InvalidArgument):
        wire.read_header(b"\x0b")  # wire type 3 (groups) is not used by OIP


RAW_CONFIG = {
    "router": {"default_timeout_s": 5, "max_in_flight": 8},
    "deployments": {
        "cpu": {"address": "127.0.0.1:1", "path": "cpu-eager", "price_micros_per_hour": 100},
        "xla": {"address": "127.0.0.1:2", "price_micros_per_hour": 300},
    },
    "routes": {
        "mlp": {"policy": "weighted", "targets": [{"deployment": "cpu", "weight": 3}, "xla"]},
        "tiny-lm": {
            "policy": "pinned",
            "targets": ["cpu"],
            "shadow": {"share": 0.5, "candidates": [{"deployment": "xla", "version": "perturbed"}]},
        },
    },
}


def test_config_parses_into_frozen_objects() -> None:
    cfg = config.parse(RAW_CONFIG)
    assert cfg.settings.default_timeout_s == 5.0 and cfg.settings.max_in_flight == 8
    assert cfg.deployment("xla").path == "xla"
    mlp, tiny = cfg.routes
    assert mlp.policy is Policy.WEIGHTED and mlp.targets[0].weight == 3.0
    assert tiny.shadow is not None and tiny.shadow.candidates[0].version == "perturbed"


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"routes": {"m": {"policy": "fastest", "targets": ["cpu"]}}}, "unknown policy"),
        ({"routes": {"m": {"targets": ["gpu"]}}}, "unknown deployment"),
        ({"routes": {"m": {"policy": "pinned", "targets": ["cpu", "xla"]}}}, "exactly one"),
        (
            {"routes": {"m": {"targets": ["cpu"], "shadow": {"share": 2, "candidates": ["xla"]}}}},
            "within 0..1",
        ),
        ({"router": {"max_in_flight": "many"}}, "must be int"),
        ({"router": {"colour": 1}}, "unknown keys"),
        ({"deployments": {"d": {"path": "x"}}}, "needs `address`"),
        ({"router": {"executor_transport": "http"}}, r"executor_transport must be one of \['frames'"),
    ],
)
def test_config_errors_say_what_to_fix(patch: dict[str, object], message: str) -> None:
    raw = {"deployments": RAW_CONFIG["deployments"], **patch}
    if "deployments" in patch:
        raw["deployments"] = patch["deployments"]
    with pytest.raises(InvalidArgument, match=message):
        config.parse(raw)


def test_cheapest_needs_prices() -> None:
    raw = {
        "deployments": {"a": {"address": "h:1"}},
        "routes": {"m": {"policy": "cheapest", "targets": ["a"]}},
    }
    with pytest.raises(InvalidArgument, match="price_micros_per_hour"):
        config.parse(raw)


def _states(*names: str, prices: tuple[int, ...] = ()) -> dict[str, DeploymentState]:
    prices = prices or (1,) * len(names)
    return {
        n: DeploymentState(Deployment(n, f"h:{i}", n, p))
        for i, (n, p) in enumerate(zip(names, prices, strict=True))
    }


def test_failover_skips_ejected_and_recovers_after_cooldown() -> None:
    settings = Settings(eject_base_s=1.0, eject_max_s=8.0)
    states = _states("a", "b")
    route = Route("m", Policy.FAILOVER, (Target("a"), Target("b")))
    rng = random.Random(1)
    assert [t.deployment for t, _ in plan(route, states, rng)] == ["a", "b"]
    states["a"].eject("down", settings, now=100.0)
    assert [t.deployment for t, _ in plan(route, states, rng)] == ["b"]
    assert not states["a"].probe_succeeded(now=100.5)  # still cooling down
    assert states["a"].probe_succeeded(now=101.0)
    assert plan(route, states, rng)[0][0].deployment == "a"
    states["a"].eject("down again", settings, now=101.5)  # soon after: the cooldown doubles
    assert states["a"].ejected_until == pytest.approx(103.5)
    states["b"].eject("down", settings, now=101.5)
    with pytest.raises(Unavailable, match="no healthy deployment"):
        plan(route, states, rng)


def test_weighted_split_follows_weights() -> None:
    states = _states("a", "b")
    route = Route("m", Policy.WEIGHTED, (Target("a", weight=9), Target("b", weight=1)))
    rng = random.Random(7)
    counts = Counter(plan(route, states, rng)[0][0].deployment for _ in range(5000))
    assert 0.87 < counts["a"] / 5000 < 0.93


def test_least_loaded_prefers_lower_reported_load_and_breaks_ties_randomly() -> None:
    states = _states("a", "b")
    route = Route("m", Policy.LEAST_LOADED, (Target("a"), Target("b")))
    rng = random.Random(3)
    states["a"].report_load(in_flight=5, queue_depth=4)
    states["b"].report_load(in_flight=1, queue_depth=0)
    assert {plan(route, states, rng)[0][0].deployment for _ in range(200)} == {"b"}
    states["a"].report_load(1, 0)
    ties = Counter(plan(route, states, rng)[0][0].deployment for _ in range(2000))
    assert 800 < ties["a"] < 1200


def test_cheapest_is_price_times_measured_service_time() -> None:
    states = _states("fast-dear", "slow-cheap", prices=(1000, 100))
    route = Route("m", Policy.CHEAPEST, (Target("fast-dear"), Target("slow-cheap")))
    rng = random.Random(5)
    # Unmeasured targets are tried first, so both get measured.
    assert {plan(route, states, rng)[0][0].deployment for _ in range(50)} == {
        "fast-dear",
        "slow-cheap",
    }
    states["fast-dear"].observe_service_time(100.0)  # 1000 x 100 = 100000
    states["slow-cheap"].observe_service_time(500.0)  # 100 x 500 = 50000
    picks = Counter(plan(route, states, rng)[0][0].deployment for _ in range(1000))
    assert picks["slow-cheap"] > 930  # the rest is exploration (5%)
    states["slow-cheap"].observe_service_time(100000.0)
    for _ in range(30):
        states["slow-cheap"].observe_service_time(100000.0)
    picks = Counter(plan(route, states, rng)[0][0].deployment for _ in range(1000))
    assert picks["fast-dear"] > 930


def test_bearer_key_parsing() -> None:
    assert bearer_key([("authorization", "Bearer k1.s")]) == "k1.s"
    with pytest.raises(Unauthenticated, match="no API key"):
        bearer_key([("x-other", "1")])
    with pytest.raises(Unauthenticated, match="Bearer"):
        bearer_key([("authorization", "Basic abc")])


class _FakeAccess:
    """An in-memory AuthPort: keys, revocation, and an outage switch."""

    def __init__(self) -> None:
        self.keys = {"good": Identity("p1", "alice", "search", "k1", (("infer", "model:mlp"),))}
        self.down = False
        self.calls = 0
        self.delay = 0.001

    async def authenticate(self, key: str) -> Identity:
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.down:
            raise Unavailable("connection refused")
        if key not in self.keys:
            raise Unauthenticated("API key is unknown, revoked or expired")
        return self.keys[key]


async def test_auth_cache_coalesces_expires_and_survives_an_outage() -> None:
    access = _FakeAccess()
    auth = Authenticator(access, ttl_s=0.2, stale_s=5.0)
    ids = await asyncio.gather(*(auth.identify("good") for _ in range(20)))
    assert {i.name for i in ids} == {"alice"} and access.calls == 1  # one lookup for 20 requests
    authorize(ids[0], "mlp")
    with pytest.raises(PermissionDenied, match="tiny-lm"):
        authorize(ids[0], "tiny-lm")
    access.down = True
    await asyncio.sleep(0.25)
    assert (await auth.identify("good")).name == "alice"  # stale but metering is down: still served
    with pytest.raises(Unavailable, match="metering is unreachable"):
        await auth.identify("never-seen")
    access.down = False
    del access.keys["good"]  # revoked
    await asyncio.sleep(0.25)
    with pytest.raises(Unauthenticated):
        await auth.identify("good")


async def test_a_key_in_steady_use_is_refreshed_ahead_so_no_request_waits_on_metering() -> None:
    access = _FakeAccess()
    access.delay = 0.3  # a slow metering: a request that waited for it would take >= 0.3 s
    auth = Authenticator(access, ttl_s=1.0, stale_s=5.0)
    await auth.identify("good")  # the first use of a key waits for its lookup
    waits = []
    end = time.monotonic() + 2.5  # steady traffic over more than two TTLs
    while time.monotonic() < end:
        t0 = time.monotonic()
        assert (await auth.identify("good")).name == "alice"
        waits.append(time.monotonic() - t0)
        await asyncio.sleep(0.02)
    assert max(waits) < 0.15, f"a request waited {max(waits):.3f} s for metering"
    assert access.calls >= 3  # refreshed in the background meanwhile
    del access.keys["good"]  # revoked: refused within the TTL plus one lookup
    revoked_at = time.monotonic()
    while True:
        try:
            await auth.identify("good")
        except Unauthenticated:
            break
        assert time.monotonic() - revoked_at < 1.0 + 0.3 + 0.2, "a revoked key kept working"
        await asyncio.sleep(0.02)
    await auth.close()


def test_the_example_config_parses(repo_root: Path) -> None:
    cfg = config.load(repo_root / "services" / "router" / "routes.example.toml")
    assert [r.model for r in cfg.routes] == ["mlp", "tiny-lm", "minilm-l6"]
    assert cfg.settings == Settings()  # the example documents the defaults


def test_cli_refuses_a_bad_config_with_a_message(tmp_path: Path, repo_root: Path) -> None:
    bad = tmp_path / "routes.toml"
    bad.write_text('[routes.mlp]\npolicy = "fastest"\ntargets = []\n')
    done = subprocess.run(
        [sys.executable, "-m", "clients.cli", "router", "serve", "--config", str(bad)],
        capture_output=True,
        text=True,
        cwd=repo_root,
        env={**os.environ, "PYTHONPATH": str(repo_root)},
        timeout=120,
    )
    assert done.returncode == 2 and "unknown policy 'fastest'" in done.stdout


def test_the_routes_switchyard_up_writes_parse() -> None:
    executors = {
        "cpu": ServiceSpec("executor-cpu", (), "127.0.0.1:8101", "grpc", models=("mlp", "tiny-lm")),
        "xla": ServiceSpec("executor-xla", (), "127.0.0.1:8102", "grpc", models=("mlp",)),
    }
    cfg = config.parse(tomllib.loads(render_routes(executors, 0.1)))
    routes = {r.model: r for r in cfg.routes}
    assert routes["mlp"].policy is Policy.PINNED and routes["mlp"].shadow is not None
    assert routes["mlp"].shadow.candidates[0].deployment == "xla"
    assert cfg.deployment("cpu").path == "cpu-eager"


def test_executor_stream_errors_keep_their_status() -> None:
    from services.inband_status import encode_error, parse
    from switchyard.grpcio import grpc_code

    found = parse("NOT_FOUND: unknown model 'x'; this executor serves ['mlp:1']")
    assert grpc_code(found) == grpc.StatusCode.NOT_FOUND and found.details.startswith("unknown model 'x'")
    assert grpc_code(parse("DEADLINE_EXCEEDED: it was not run")) == grpc.StatusCode.DEADLINE_EXCEEDED
    for odd in ("no status here", "OK: fine", "NOPE: what"):
        assert grpc_code(parse(odd)) == grpc.StatusCode.UNKNOWN and parse(odd).details == odd
    # what the executor writes is what the router reads back: one codec on both ends
    again = parse(encode_error(Unavailable("draining; retry elsewhere"), "/test"))
    assert grpc_code(again) == grpc.StatusCode.UNAVAILABLE and again.details == "draining; retry elsewhere"


async def test_kept_route_changes_that_no_longer_fit_are_skipped_and_bad_files_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config.parse(RAW_CONFIG)
    routes = {r.model: r for r in cfg.routes}
    store = RouteStore(tmp_path)
    assert store.routes(routes, cfg.deployments) == routes  # no file yet: the config's routes
    gone = Route("mlp", Policy.PINNED, (Target("xla"),))
    await store.save("mlp", gone)
    await store.save("tiny-lm", None)
    fewer = tuple(d for d in cfg.deployments if d.name != "xla")  # the config changed since
    with caplog.at_level("WARNING"):
        applied = RouteStore(tmp_path).routes(routes, fewer)
    assert applied["mlp"] == routes["mlp"] and "tiny-lm" not in applied
    assert "skipping the kept change to route 'mlp'" in caplog.text and "'xla'" in caplog.text
    assert RouteStore(tmp_path).routes(routes, cfg.deployments)["mlp"] == gone  # it fits again
    (tmp_path / "routes-state.json").write_text("{not json")
    with caplog.at_level("WARNING"):
        assert RouteStore(tmp_path).routes(routes, cfg.deployments) == routes
    assert "unreadable" in caplog.text


class FleetStore:
    """The fleet's shared changes as metering keeps them: a revision per change, latest wins."""

    def __init__(self) -> None:
        self.changes: dict[str, Change] = {}
        self.revision = 0
        self.down = False

    async def save_route_change(self, change: RouteChange) -> int:
        if self.down:
            raise Unavailable("metering did not answer")
        self.revision += 1
        self.changes[change.model] = Change(change.table, self.revision)
        return self.revision

    async def route_changes(self, fleet: str) -> dict[str, Change]:
        if self.down:
            raise Unavailable("metering did not answer")
        return dict(self.changes)


async def test_shared_route_changes_newer_revision_wins_and_are_cached(tmp_path: Path) -> None:
    cfg = config.parse(RAW_CONFIG)
    routes = {r.model: r for r in cfg.routes}
    fleet = FleetStore()
    one, two = RouteStore(tmp_path / "one", fleet), RouteStore(tmp_path / "two", fleet)
    pinned_xla = Route("mlp", Policy.PINNED, (Target("xla"),))
    await one.save("mlp", pinned_xla, None, "ops", "req-1")
    assert await two.sync() and two.routes(routes, cfg.deployments)["mlp"] == pinned_xla
    assert not await two.sync()  # nothing newer
    await two.save("tiny-lm", None)
    stale = dict(fleet.changes)  # a poll that started before the next change answers late
    pinned_cpu = Route("mlp", Policy.PINNED, (Target("cpu"),))
    await one.save("mlp", pinned_cpu)
    fleet.changes, latest = stale, fleet.changes
    assert await one.sync()  # takes the deletion, keeps its own newer change to mlp
    assert one.routes(routes, cfg.deployments)["mlp"] == pinned_cpu
    assert "tiny-lm" not in one.routes(routes, cfg.deployments)
    fleet.changes, fleet.down = latest, True
    with pytest.raises(Unavailable, match="could not save the route change in metering"):
        await two.save("mlp", pinned_xla)
    assert two.changes["mlp"].table == route_table(pinned_xla)  # unchanged by the refusal
    cached = RouteStore(tmp_path / "one", fleet).routes(routes, cfg.deployments)  # metering down
    assert cached["mlp"] == pinned_cpu and "tiny-lm" not in cached
