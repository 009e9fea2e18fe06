"""CLI of the metering service and the finance tools (registration only; work is lazy-imported).

switchyard metering serve --db URL --port N
switchyard ledger report|export|html      (reads, through the metering service)
switchyard audit verify|query|reanchor
switchyard prices set, switchyard keys create|revoke, switchyard roles grant|revoke,
switchyard principals create             (writes, always through the metering service:
                                           it is the ledger's only writer)
"""

from __future__ import annotations

import argparse
import os
from typing import Any

DEFAULT_ADDRESS = "127.0.0.1:8201"


def _client(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metering",
        default=os.environ.get("SWITCHYARD_METERING_ADDRESS", DEFAULT_ADDRESS),
        help="metering service address (default $SWITCHYARD_METERING_ADDRESS or %(default)s)",
    )
    p.add_argument(
        "--as", dest="actor", default=os.environ.get("USER", "cli"), help="who acts, for the audit trail"
    )


def _client_command(p: argparse.ArgumentParser, name: str) -> None:
    """A command that calls the metering service: its address and actor options, run by
    `clients.metering_commands.<name>`."""
    _client(p)
    p.set_defaults(func=_run(name))


def _window(p: argparse.ArgumentParser) -> None:
    p.add_argument("--since", default="", help="ISO date/time (UTC) or microseconds since the epoch")
    p.add_argument(
        "--until", default="", help="ISO date/time (UTC) or microseconds since the epoch; default now"
    )


def _run(name: str) -> Any:
    def call(args: argparse.Namespace) -> int:
        from clients import metering_commands

        return int(getattr(metering_commands, name)(args))

    return call


def register(sub: argparse._SubParsersAction[Any]) -> None:
    _register_metering(sub)
    _register_ledger(sub)
    _register_audit(sub)
    _register_admin(sub)


def _register_metering(sub: argparse._SubParsersAction[Any]) -> None:
    metering = sub.add_parser("metering", help="the metering service (ledger writer)")
    msub = metering.add_subparsers(dest="metering_command", required=True)
    serve = msub.add_parser("serve", help="serve the ledger over gRPC")
    serve.add_argument(
        "--db",
        default=None,
        help="database URL or SQLite file (default $SWITCHYARD_DATABASE_URL, var/metering.db)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8201)
    serve.add_argument("--metrics-port", type=int, default=None)  # help: clients.cli_help
    serve.set_defaults(func=_run("serve"))
    mig = msub.add_parser(
        "migrate",
        help="bring the database to the newest schema (run as the schema's owner)",
        epilog="example: switchyard metering migrate --db postgresql://migrator@db/ledger "
        "--runtime-role switchyard_runtime",
    )
    mig.add_argument("--db", default=None, help="database URL (default $SWITCHYARD_DATABASE_URL)")
    mig.add_argument(
        "--runtime-role",
        default=None,
        help="PostgreSQL role the service runs as; its grants are reset to exactly what it needs "
        "(INSERT/SELECT only on the journal and audit trail; default $SWITCHYARD_DATABASE_RUNTIME_ROLE)",
    )
    mig.set_defaults(func=_run("migrate"))


def _register_ledger(sub: argparse._SubParsersAction[Any]) -> None:
    ledger = sub.add_parser("ledger", help="finance reports and exports")
    lsub = ledger.add_subparsers(dest="ledger_command", required=True)
    report = lsub.add_parser("report", help="cost per group, with cost per completed job")
    report.add_argument("--by", default="path", help="comma-separated: path, model, team, day")
    report.add_argument("--trial", default="", help="only this trial's lines and jobs")
    report.add_argument("--format", choices=("table", "csv", "json"), default="table")
    _window(report)
    _client_command(report, "report")
    export = lsub.add_parser("export", help="the journal as CSV or FOCUS 1.2 columns")
    export.add_argument("--format", choices=("focus", "csv"), default="focus")
    export.add_argument("-o", "--output", required=True, help="file to write ('-' = stdout)")
    _window(export)
    _client_command(export, "export")
    html = lsub.add_parser("html", help="a self-contained HTML report with charts")
    html.add_argument("-o", "--output", required=True)
    _window(html)
    _client_command(html, "html")

    reverse = lsub.add_parser("reverse", help="correct the ledger: a reversal line cancels one usage line")
    reverse.add_argument("line_key", help="idempotency key of the usage line to cancel")
    reverse.add_argument("--reason", required=True)
    reverse.add_argument("--key", default="", help="idempotency key of the correction (default: derived)")
    _client_command(reverse, "reverse")


def _register_audit(sub: argparse._SubParsersAction[Any]) -> None:
    audit = sub.add_parser("audit", help="the audit trail")
    asub = audit.add_subparsers(dest="audit_command", required=True)
    verify = asub.add_parser("verify", help="recompute the hash chain; name the first broken row")
    _client_command(verify, "audit_verify")
    reanchor = asub.add_parser(
        "reanchor",
        help="after investigating an integrity failure: anchor the chain as it is now (local; "
        "needs the database and the audit key; restart metering afterwards)",
    )
    reanchor.add_argument("--db", default=None, help="database URL (default $SWITCHYARD_DATABASE_URL)")
    reanchor.add_argument("--reason", required=True, help="what the investigation found (audited)")
    reanchor.add_argument("--as", dest="actor", default=os.environ.get("USER", "cli"), help="who acts")
    reanchor.set_defaults(func=_run("audit_reanchor"))
    query = asub.add_parser("query", help="recent audit rows")
    query.add_argument("--action", default="")
    query.add_argument("--principal", default="")
    query.add_argument("--limit", type=int, default=50)
    _window(query)
    _client_command(query, "audit_query")


def _register_admin(sub: argparse._SubParsersAction[Any]) -> None:
    """Prices, principals, keys and roles: the audited admin commands."""
    prices = sub.add_parser("prices", help="the dated price book")
    psub = prices.add_subparsers(dest="prices_command", required=True)
    pset = psub.add_parser("set", help="set a price from a date on (audited)")
    pset.add_argument("price_key")
    pset.add_argument("per_hour", help="price per hour as a decimal, e.g. 1.25 (exact; no floats)")
    pset.add_argument("--currency", default="USD")
    pset.add_argument(
        "--from", dest="effective_from", default="", help="ISO date/time or microseconds; default now"
    )
    _client_command(pset, "prices_set")

    principals = sub.add_parser("principals", help="users, services and teams")
    prsub = principals.add_subparsers(dest="principals_command", required=True)
    pcreate = prsub.add_parser("create")
    pcreate.add_argument("name")
    pcreate.add_argument("--kind", choices=("user", "service", "team"), default="user")
    pcreate.add_argument("--team", default="")
    _client_command(pcreate, "principals_create")

    keys = sub.add_parser("keys", help="API keys (the secret is shown once)")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    kcreate = ksub.add_parser("create")
    kcreate.add_argument("principal", help="principal name or id")
    kcreate.add_argument("--expires", default="", help="ISO date/time or microseconds; default never")
    _client_command(kcreate, "keys_create")
    krevoke = ksub.add_parser("revoke")
    krevoke.add_argument("key_id")
    _client_command(krevoke, "keys_revoke")

    roles = sub.add_parser(
        "roles", help="role bindings (infer, trials:run, workloads:read, ledger:read, admin)"
    )
    rsub = roles.add_subparsers(dest="roles_command", required=True)
    for verb in ("grant", "revoke"):
        rp = rsub.add_parser(verb)
        rp.add_argument("principal")
        rp.add_argument("role")
        rp.add_argument("--scope", default="*", help="'*', 'model:<name>' or 'team:<name>'")
        _client_command(rp, f"roles_{verb}")
