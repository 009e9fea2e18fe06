"""`switchyard up`'s OpenAI API and generative default: the config key, the plan, the routes."""

from __future__ import annotations

import socket
import tomllib
from pathlib import Path

import pytest

from clients.local_cluster.cluster_config import ConfigError, load_config
from clients.local_cluster.local_routes import render_routes
from clients.local_cluster.plan import build_plan
from clients.local_cluster.up import LocalCluster
from switchyard.errors import FailedPrecondition
from tests.conftest import ROOT

NO_XLA = {"SWITCHYARD_EXECUTORS_XLA_ENABLED": "false"}


def _router_argv(env: dict[str, str], path: Path | None = None) -> tuple[list[str], str]:
    specs, _ = build_plan(load_config(path, env={**NO_XLA, **env}), ROOT)
    router = next(s for s in specs if s.name == "router")
    return list(router.argv), router.info


def test_the_openai_api_is_on_port_8000_by_default() -> None:
    argv, info = _router_argv({})
    assert argv[argv.index("--openai-port") + 1] == "8000"
    assert info == "OpenAI API http://127.0.0.1:8000/v1"


def test_the_environment_moves_it_and_minus_one_turns_it_off() -> None:
    argv, _ = _router_argv({"SWITCHYARD_ROUTER_OPENAI_PORT": "8010"})
    assert argv[argv.index("--openai-port") + 1] == "8010"
    argv, info = _router_argv({"SWITCHYARD_ROUTER_OPENAI_PORT": "-1"})
    assert argv[argv.index("--openai-port") + 1] == "-1" and info == ""


def test_port_zero_is_a_free_port_no_other_service_has(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text(
        "[temporal]\nport = 0\nui_port = 0\n[metering]\nport = 0\n[evaluator]\nport = 0\n"
        "[router]\nport = 0\nopenai_port = 0\n[executors.cpu]\nport = 0\n"
    )
    specs, ports = build_plan(load_config(f, env=NO_XLA), ROOT)
    taken = {int(s.address.rsplit(":", 1)[1]) for s in specs if s.address}
    assert ports.openai > 0 and ports.openai not in taken


@pytest.mark.parametrize("value", ["-2", "70000"])
def test_a_bad_openai_port_names_the_key(value: str) -> None:
    with pytest.raises(ConfigError, match=r"'router.openai_port' must be -1 \(off\) or between 0 and 65535"):
        load_config(env={"SWITCHYARD_ROUTER_OPENAI_PORT": value})


def test_the_cpu_executor_serves_tiny_lm_gen_with_a_route() -> None:
    specs, _ = build_plan(load_config(env=NO_XLA), ROOT)
    executors = {s.name.removeprefix("executor-"): s for s in specs if s.name.startswith("executor-")}
    assert "tiny-lm-gen" in executors["cpu"].models
    routes = tomllib.loads(render_routes(executors, 0.2))
    assert routes["routes"]["tiny-lm-gen"] == {"policy": "pinned", "targets": ["cpu"]}


def test_a_taken_openai_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        f = tmp_path / "c.toml"
        f.write_text(
            f'state_dir = "{tmp_path / "state"}"\n[temporal]\nport = 0\nui_port = 0\n[metering]\nport = 0\n'
            f"[evaluator]\nport = 0\n[router]\nport = 0\nopenai_port = {port}\n[executors.cpu]\nport = 0\n"
            '[security]\ninsecure = true\n[models]\nrepository = "' + str(tmp_path / "models") + '"\n'
        )
        cluster = LocalCluster(load_config(f, env=NO_XLA), say=lambda _: None)
        with pytest.raises(FailedPrecondition, match=f"port {port} for the router's OpenAI API is in use"):
            cluster.prepare()
