"""The cluster configuration: defaults, file, environment, and errors that name the key."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from clients.local_cluster.cluster_config import ConfigError, env_names, load_config
from clients.local_cluster.local_routes import render_routes
from clients.local_cluster.plan import build_plan, child_pythonpath, enabled_executors
from tests.conftest import ROOT


def test_embedded_defaults_are_the_documented_ports() -> None:
    c = load_config(env={})
    assert (c.router.port, c.metering_port, c.evaluator_port) == (8001, 8201, 8301)
    assert (c.temporal.port, c.temporal.ui_port, c.temporal.local) == (7233, 8233, True)
    assert {e.backend: e.port for e in c.executors} == {"cpu": 8101, "xla": 8102, "cuda": 8103, "tpu": 8104}
    assert c.ledger_url.startswith("sqlite:///") and c.ledger_url.endswith("var/cluster/ledger.db")


def test_file_then_environment_override_in_that_order(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[router]\nport = 9001\nshadow_share = 0.5\n[executors.cpu]\nmodels = ["mlp"]\n')
    c = load_config(f, env={"SWITCHYARD_ROUTER_PORT": "9002", "SWITCHYARD_EXECUTORS_XLA_ENABLED": "false"})
    assert c.router.port == 9002  # environment beats file
    assert c.router.shadow_share == 0.5  # file beats defaults
    assert c.executor("cpu").models == ("mlp",)
    assert c.executor("xla").enabled == "false"


def test_environment_values_are_typed() -> None:
    env = {
        "SWITCHYARD_EXECUTORS_CPU_MODELS": "mlp, tiny-lm",
        "SWITCHYARD_WORKER_ENABLED": "no",
        "SWITCHYARD_ROUTER_SHADOW_SHARE": "0.25",
    }
    c = load_config(env=env)
    assert c.executor("cpu").models == ("mlp", "tiny-lm")
    assert c.worker_enabled is False
    assert c.router.shadow_share == 0.25
    with pytest.raises(ConfigError, match="SWITCHYARD_ROUTER_PORT='eighty'"):
        load_config(env={"SWITCHYARD_ROUTER_PORT": "eighty"})


def test_postgres_url_and_remote_temporal_pass_through_unchanged() -> None:
    env = {
        "SWITCHYARD_DATABASE_URL": "postgresql+psycopg://postgres@127.0.0.1:5432/ledger",
        "SWITCHYARD_TEMPORAL_ADDRESS": "temporal.prod:7233",
        "SWITCHYARD_EXECUTORS_XLA_ENABLED": "false",
    }
    c = load_config(env=env)
    assert c.ledger_url == env["SWITCHYARD_DATABASE_URL"]
    specs, _ = build_plan(c, ROOT)
    names = [s.name for s in specs]
    assert "temporal" not in names  # a remote Temporal: no dev server here
    metering = next(s for s in specs if s.name == "metering")
    assert metering.env["SWITCHYARD_DATABASE_URL"] == env["SWITCHYARD_DATABASE_URL"]
    worker = next(s for s in specs if s.name == "trial-worker")
    assert "temporal.prod:7233" in worker.argv


def test_xla_interpreter_alias_and_its_precedence(tmp_path: Path) -> None:
    c = load_config(env={"SWITCHYARD_XLA_PYTHON": "/a/python"})
    assert c.executor("xla").python == "/a/python"
    c = load_config(
        env={"SWITCHYARD_XLA_PYTHON": "/a/python", "SWITCHYARD_EXECUTORS_XLA_PYTHON": "/b/python"}
    )
    assert c.executor("xla").python == "/b/python"


def test_auto_executors_start_only_where_their_environment_exists(tmp_path: Path) -> None:
    missing = load_config(env={"SWITCHYARD_XLA_PYTHON": str(tmp_path / "nope")})
    assert "xla" not in [e.backend for e, _ in enabled_executors(missing)]
    present = load_config(env={"SWITCHYARD_XLA_PYTHON": sys.executable})
    assert "xla" in [e.backend for e, _ in enabled_executors(present)]
    forced = load_config(
        env={"SWITCHYARD_XLA_PYTHON": str(tmp_path / "nope"), "SWITCHYARD_EXECUTORS_XLA_ENABLED": "true"}
    )
    with pytest.raises(ConfigError, match="make setup-xla"):
        enabled_executors(forced)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[router]\nprot = 1\n", "unknown configuration key 'router.prot'"),
        ("[router]\nport = true\n", "'router.port' must be a int"),
        ("[router]\nport = 70000\n", "between 0 and 65535"),
        ("[router]\nshadow_share = 2\n", r"within \[0, 1\]"),
        ('[database]\nurl = "mysql://x"\n', "sqlite:// or postgresql://"),
        ("[executors.gpu9]\nport = 1\n", "unknown configuration key 'executors.gpu9'"),
        ('[executors.cpu]\nenabled = "maybe"\n', "true, false or"),
        ("router = [", "not valid TOML"),
    ],
)
def test_bad_configuration_names_the_key(tmp_path: Path, toml: str, message: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError, match=message):
        load_config(f, env={})


def test_missing_file_is_reported() -> None:
    with pytest.raises(ConfigError, match="cannot read configuration file"):
        load_config("/nonexistent/switchyard.toml", env={})


def test_env_names_cover_the_documented_variables() -> None:
    names = env_names()
    assert {
        "SWITCHYARD_DATABASE_URL",
        "SWITCHYARD_TEMPORAL_ADDRESS",
        "SWITCHYARD_XLA_PYTHON",
        "SWITCHYARD_EXECUTORS_CPU_PORT",
        "SWITCHYARD_CONFIG",
    } <= names


def test_port_zero_gets_a_free_port_for_every_service(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text(
        "[temporal]\nport = 0\nui_port = 0\n[metering]\nport = 0\n[evaluator]\nport = 0\n[router]\nport = 0\n"
        "openai_port = 0\n[executors.cpu]\nport = 0\n[executors.xla]\nenabled = false\n"
    )
    specs, ports = build_plan(load_config(f, env={}), ROOT)
    addresses = [s.address for s in specs if s.address]
    assert len(set(addresses)) == len(addresses)
    assert all(not a.endswith(":0") for a in addresses)
    assert ports.router != 8001


def test_derived_routes_pin_cpu_and_shadow_to_xla() -> None:
    c = load_config(env={"SWITCHYARD_XLA_PYTHON": sys.executable})
    specs, _ = build_plan(c, ROOT)
    executors = {s.name.removeprefix("executor-"): s for s in specs if s.name.startswith("executor-")}
    text = render_routes(executors, 0.2)
    import tomllib

    routes = tomllib.loads(text)
    assert routes["deployments"]["cpu"]["address"] == "127.0.0.1:8101"
    assert routes["routes"]["mlp"]["targets"] == ["cpu"]
    assert routes["routes"]["mlp"]["shadow"] == {"share": 0.2, "candidates": ["xla"]}
    assert "shadow" not in routes["routes"]["minilm-l6"]  # the XLA executor does not serve it


def test_dev_server_registers_the_search_attributes_the_workflow_upserts() -> None:
    from temporalio.common import SearchAttributeIndexedValueType

    from clients.local_cluster.plan import SEARCH_ATTRIBUTES
    from workflows.trial import MODEL, PATHS, VERDICT

    kinds = {
        SearchAttributeIndexedValueType.KEYWORD: "Keyword",
        SearchAttributeIndexedValueType.KEYWORD_LIST: "KeywordList",
    }
    assert dict(SEARCH_ATTRIBUTES) == {
        key.name: kinds[key.indexed_value_type] for key in (MODEL, PATHS, VERDICT)
    }


def test_demo_inputs_use_the_sequence_length_executors_warm_up_with() -> None:
    """XLA compiles per shape: demo traffic and the demo trial must send tiny-lm sequences of
    the length the executor warms every bucket with, or they compile while measured."""
    from clients.local_cluster import traffic
    from clients.local_cluster.demo_trial import demo_spec
    from switchyard.models import tiny_lm

    assert traffic.DEFAULT_SEQ == tiny_lm.DEFAULT_SEQ
    assert demo_spec("t")["inputs"]["tensors"][0]["shape"][1] == tiny_lm.DEFAULT_SEQ


def test_children_get_the_checkout_and_the_callers_whole_pythonpath(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/opt/plugins", "/srv/models"]))
    specs, _ = build_plan(load_config(env={"SWITCHYARD_EXECUTORS_XLA_ENABLED": "false"}), ROOT)
    for spec in specs:
        if "PYTHONPATH" in spec.env:
            assert spec.env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/opt/plugins", "/srv/models"]
    assert child_pythonpath(ROOT, str(ROOT)) == str(ROOT)  # not twice
    assert child_pythonpath(None, "/a") == "/a"  # an installed package adds nothing


def test_the_audit_witness_starts_before_metering_which_gets_only_its_address_and_public_key(
    tmp_path: Path,
) -> None:
    """`up` runs the witness as its own process with its own folder (its private key never
    leaves it); metering is told where it is and the public key's file; -1 turns it off."""
    c = load_config(env={"SWITCHYARD_STATE_DIR": str(tmp_path), "SWITCHYARD_EXECUTORS_XLA_ENABLED": "false"})
    specs, ports = build_plan(c, ROOT)
    names = [s.name for s in specs]
    assert names.index("witness") < names.index("metering")
    witness, metering = specs[names.index("witness")], specs[names.index("metering")]
    assert witness.probe == "http" and witness.address == f"127.0.0.1:{ports.witness}" and ports.witness > 0
    assert witness.argv[witness.argv.index("--dir") + 1] == str(tmp_path.resolve() / "witness")
    assert metering.env["SWITCHYARD_AUDIT_WITNESS"] == f"http://{witness.address}"
    assert metering.env["SWITCHYARD_AUDIT_WITNESS_KEY"] == str(tmp_path.resolve() / "witness" / "witness.pub")
    off, _ = build_plan(load_config(env={"SWITCHYARD_WITNESS_PORT": "-1"}), ROOT)
    assert "witness" not in [s.name for s in off]
    assert not any("SWITCHYARD_AUDIT_WITNESS" in s.env for s in off)
    with pytest.raises(ConfigError, match=r"witness\.port"):
        load_config(env={"SWITCHYARD_WITNESS_PORT": "-2"})


def test_the_dev_server_reads_payloads_through_the_codec_endpoint_up_serves(tmp_path: Path) -> None:
    """The UI's codec endpoint starts before the dev server, on the UI's host, with the codec's
    keys and the UI's origin; the dev server is told its URL; the worker gets the same keys."""
    c = load_config(env={"SWITCHYARD_STATE_DIR": str(tmp_path), "SWITCHYARD_EXECUTORS_XLA_ENABLED": "false"})
    specs, ports = build_plan(c, ROOT)
    names = [s.name for s in specs]
    assert names.index("temporal-codec") < names.index("temporal")
    codec, temporal = specs[names.index("temporal-codec")], specs[names.index("temporal")]
    assert codec.probe == "http" and codec.address == f"127.0.0.1:{ports.codec}" and ports.codec > 0
    keys = str(tmp_path.resolve() / "keys" / "temporal-codec.key")
    assert codec.argv[codec.argv.index("--key-file") + 1] == keys
    assert codec.argv[codec.argv.index("--origin") + 1] == f"http://127.0.0.1:{ports.temporal_ui}"
    assert temporal.argv[temporal.argv.index("--ui-codec-endpoint") + 1] == f"http://{codec.address}"
    worker = specs[names.index("trial-worker")]
    assert worker.env["SWITCHYARD_TEMPORAL_CODEC_KEY_FILE"] == keys
    assert "SWITCHYARD_TEMPORAL_TLS" not in worker.env  # the dev server offers no TLS


def test_a_remote_temporal_with_tls_is_dialled_with_it(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    env = {
        "SWITCHYARD_TEMPORAL_ADDRESS": "temporal.prod:7233",
        "SWITCHYARD_TEMPORAL_TLS_CA": str(ca),
        "SWITCHYARD_TEMPORAL_TLS_SERVER_NAME": "frontend.temporal",
        "SWITCHYARD_EXECUTORS_XLA_ENABLED": "false",
    }
    specs, ports = build_plan(load_config(env=env), ROOT)
    assert not any(s.name.startswith("temporal") for s in specs) and ports.codec == -1
    worker = next(s for s in specs if s.name == "trial-worker")
    assert worker.env["SWITCHYARD_TEMPORAL_TLS"] == "true"
    assert worker.env["SWITCHYARD_TEMPORAL_TLS_CA"] == str(ca.resolve())
    assert worker.env["SWITCHYARD_TEMPORAL_TLS_SERVER_NAME"] == "frontend.temporal"
    system_ca = {k: v for k, v in env.items() if "TLS_" not in k} | {"SWITCHYARD_TEMPORAL_TLS": "true"}
    specs, _ = build_plan(load_config(env=system_ca), ROOT)
    worker = next(s for s in specs if s.name == "trial-worker")
    assert worker.env["SWITCHYARD_TEMPORAL_TLS"] == "true" and "SWITCHYARD_TEMPORAL_TLS_CA" not in worker.env
    with pytest.raises(ConfigError, match="certificate needs its key"):
        build_plan(load_config(env={**env, "SWITCHYARD_TEMPORAL_TLS_CERT": str(ca)}), ROOT)
