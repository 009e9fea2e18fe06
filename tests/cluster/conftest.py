"""The one `switchyard up` that the tests of a plain cluster share (test_up_codec.py,
test_up_openai.py, test_up_user_model.py): started once for the package, as a user runs it.

- The embedded defaults (mTLS between the services, callers' keys checked, the trial worker
  on, the codec and the witness), with every port free (0) and the CPU executor only; the
  environment loses the suite's SWITCHYARD_SECURITY_* (plaintext) and any SWITCHYARD_TEMPORAL*
  (a remote Temporal), so the cluster is the one `switchyard up` gives on a fresh machine.
- The CPU executor serves the default models (the generative tiny-lm-gen among them) and a
  user's model, team-bert, built with transformers and `switchyard models add`-ed into the
  repository before the start (`up` adds the named built-ins beside it).

The tests share its ledger, so each reads only its own rows: its own team (team-openai,
team-sealed) or its own workflow id. test_up_openai.py sets the CPU path's example price dearer
from its start (a job of a few ms then costs whole micro-units); the other tests check only
that costs are priced at the example book, which stays so.

Set apart, each on purpose: test_main_job.py runs `demo` (the XLA executor, the main job, a
stop after which nothing is left), test_healing.py SIGKILLs the executor and `up`,
test_external.py uses PostgreSQL and a remote Temporal, test_cluster_cli.py `up`'s refusals,
and tests/test_packaging.py runs `up` from an installed wheel.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from clients.cli import main as switchyard
from tests.cluster.up_helpers import UpCluster, start_up, stop_up, wait_for_state
from tests.conftest import ROOT
from tests.hf_models import save_tiny_bert

USER_MODEL = "team-bert"
DEFAULT_MODELS = ("mlp", "tiny-lm", "minilm-l6", "tiny-lm-gen")  # cluster_config's [executors.cpu]


@pytest.fixture(scope="package")
def up_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpCluster]:
    root = tmp_path_factory.mktemp("up")
    models = root / "models"
    save_tiny_bert(root / "bert", layers=1, labels=2)
    assert switchyard(["models", "add", USER_MODEL, str(root / "bert"), "--repository", str(models)]) == 0
    served = ", ".join(f'"{m}"' for m in (*DEFAULT_MODELS, USER_MODEL))
    config = root / "switchyard.toml"
    config.write_text(
        f'state_dir = "{root / "state"}"\n[models]\nrepository = "{models}"\n'
        "[temporal]\nport = 0\nui_port = 0\n[metering]\nport = 0\n[evaluator]\nport = 0\n"
        f"[router]\nport = 0\nopenai_port = 0\n[executors.cpu]\nport = 0\nmodels = [{served}]\n"
        "[executors.xla]\nenabled = false\n[executors.cuda]\nenabled = false\n"
        "[executors.tpu]\nenabled = false\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SWITCHYARD_SECURITY_", "SWITCHYARD_TEMPORAL"))
    }
    log = root / "up.log"
    proc = start_up(config, root, log, {**env, "PYTHONPATH": str(ROOT)})
    try:
        yield UpCluster(root, wait_for_state(proc, root / "state" / "cluster.json", log))
    finally:
        stop_up(proc)
