"""The official `openai` client against a plain `switchyard up` (the package's, its own
process, mTLS between the services, every port 0, the default models: tests/cluster/conftest.py):
completions streamed and not, `n`, `usage`, and per request a job in the ledger with its
tokens; the demo's streamed step and the finance report's cost per million output tokens
against the same cluster."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy import create_engine, select

from clients.local_cluster import demo_finance as finance
from clients.local_cluster import demo_generation as gen_demo
from clients.local_cluster.demo import Endpoints
from clients.local_cluster.traffic import TeamKey, create_team_key
from services.metering.schema import LINES
from switchyard import tls
from tests.cluster.up_helpers import UpCluster, logged

pytestmark = pytest.mark.slow
MODEL = "tiny-lm-gen"
PROMPT = "the quick brown"
TOKENS = 6


@pytest.fixture(scope="module")
def cluster(up_cluster: UpCluster) -> Iterator[tuple[dict[str, Any], Path]]:
    """The package's `switchyard up` (tests/cluster/conftest.py), this module's calls to it
    over its mTLS."""
    tls.set_default(tls.Security.from_dir(up_cluster.state["tls_dir"]))
    try:
        yield up_cluster.state, up_cluster.ledger
    finally:
        tls.set_default(None)


@pytest.fixture(scope="module")
def team(cluster: tuple[dict[str, Any], Path]) -> TeamKey:
    state, _ = cluster
    ep = Endpoints.from_state(state)
    # Priced from now on (the shared cluster's earlier trials are charged already), still at
    # the example book, dear enough that a job of a few ms costs whole micro-units (at the
    # demo's list price one costs under one, and rounds to 0).
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(finance.LOCAL_PRICES, "cpu", 36_000_000_000)
        asyncio.run(finance.ensure_prices(ep.metering, ep.executors, ep.paths, time.time_ns() // 1000))
    return asyncio.run(create_team_key(ep.metering, "team-openai"))


def _lines(ledger: Path, team: str, expected: int) -> list[Any]:
    """The team's ledger lines of MODEL, once `expected` of them have landed (spool batches)."""
    engine = create_engine(f"sqlite:///{ledger}")
    query = select(LINES.c.job_id, LINES.c.prompt_tokens, LINES.c.output_tokens, LINES.c.amount_micros)
    query = query.where(LINES.c.team == team, LINES.c.model == MODEL).order_by(LINES.c.id)
    try:
        for _ in range(300):
            with engine.connect() as conn:
                rows = list(conn.execute(query))
            if len(rows) >= expected:
                return rows
            time.sleep(0.1)
    finally:
        engine.dispose()
    raise AssertionError(f"{len(rows)} ledger lines of {MODEL} for {team}, expected {expected}")


def test_up_serves_the_openai_api_with_usage_and_a_job_per_request(
    cluster: tuple[dict[str, Any], Path], team: TeamKey
) -> None:
    state, ledger = cluster
    assert state["openai_url"].startswith("http://127.0.0.1:") and not state["openai_url"].endswith(
        ":8000/v1"
    )
    up_log = logged(Path(state["state_dir"]).parent / "up.log", "cluster is up after")
    assert "router started from its standby" in up_log  # its imports ran while the back ends started
    client = openai.OpenAI(base_url=state["openai_url"], api_key=team.key, max_retries=0)
    greedy: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
    greedy["extra_body"] = {"ignore_eos": True}
    assert [m.id for m in client.models.list()].count(MODEL) == 1

    whole = client.completions.create(**greedy)
    assert whole.usage is not None and whole.usage.completion_tokens == TOKENS
    prompt_tokens = whole.usage.prompt_tokens
    assert prompt_tokens == len(PROMPT.encode())  # tiny-lm-gen's tokenizer is the UTF-8 bytes
    assert whole.choices[0].text and whole.choices[0].finish_reason == "length"

    chunks = list(client.completions.create(**greedy, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text and len([c for c in chunks if c.choices]) >= 2
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, TOKENS)

    two = client.completions.create(**greedy, n=2)
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert {c.text for c in two.choices} == {whole.choices[0].text}  # greedy choices are equal
    assert two.usage is not None and (two.usage.prompt_tokens, two.usage.completion_tokens) == (
        prompt_tokens,
        2 * TOKENS,
    )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=state["openai_url"], api_key="sk_wrong", max_retries=0).completions.create(
            **greedy
        )
    client.close()

    rows = _lines(ledger, team.team, 4)  # one, one streamed, two choices: a job each
    assert len(rows) == 4 and len({r.job_id for r in rows}) == 4 and all(r.job_id for r in rows)
    assert [(r.prompt_tokens, r.output_tokens) for r in rows] == [(prompt_tokens, TOKENS)] * 4
    assert all(r.amount_micros is not None and r.amount_micros > 0 for r in rows)


def test_the_demo_streams_and_the_report_prices_output_tokens(
    cluster: tuple[dict[str, Any], Path], team: TeamKey
) -> None:
    state, ledger = cluster
    ep = Endpoints.from_state(state)
    since_us = int(time.time() * 1_000_000)
    before = len(_lines(ledger, team.team, 0))
    told: list[str] = []
    done = asyncio.run(gen_demo.demo_generation(ep.openai_url, team.key, ep.models, told.append))
    assert done is not None and done.completion_tokens > 0 and done.chunks >= 1
    assert done.text == "".join(done.deltas) and MODEL in told[0]
    rows = _lines(ledger, team.team, before + 1)
    assert rows[-1].output_tokens == done.completion_tokens
    report: list[finance.PathCost] = []
    for _ in range(100):  # the line is in; its cost row follows from the same ledger
        report = asyncio.run(finance.report(ep.metering, since_us))
        if any(r.output_tokens for r in report):
            break
        time.sleep(0.1)
    cpu = next(r for r in report if r.path == ep.paths["cpu"])
    assert cpu.output_tokens == done.completion_tokens
    # The ledger's exact figure: the generation jobs' cost x 10^6 / their output tokens.
    exact = rows[-1].amount_micros * 1_000_000 / cpu.output_tokens
    assert cpu.cost_per_million_output_tokens_micros > 0
    assert abs(cpu.cost_per_million_output_tokens_micros - exact) <= 1
    table = finance.format_table(report)
    assert (
        "per 1M output tokens" in table and finance.money(cpu.cost_per_million_output_tokens_micros) in table
    )
