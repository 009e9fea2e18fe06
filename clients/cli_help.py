"""Help text the command modules share: what an option means with its unit, and examples.

Each service's CLI module registers its own subcommands and may give its own help; whatever
an option leaves without help gets it here, by option name (with the unit: seconds, bytes,
microseconds, a count), and every command without an epilog gets its examples. One place,
so the same option reads the same everywhere. tests/test_cli_help.py checks that no option
is left without help and no command without examples.
"""

from __future__ import annotations

import argparse

# option dest -> help (argparse expands %(default)s)
COMMON: dict[str, str] = {
    "host": "address to bind, e.g. 0.0.0.0 for every interface (default %(default)s)",
    "port": "TCP port to serve on; 0 = any free port (default %(default)s)",
    "address": "the service's host:port (default %(default)s)",
    "timeout": "seconds to wait for each call (default %(default)s)",
    "db": "database URL or SQLite file (default $SWITCHYARD_DATABASE_URL, else var/metering.db)",
    "json": "print JSON instead of a table",
    "model": "model name as routed or served, e.g. mlp",
    "version": "model version (default: the repository's default version)",
    "format": "output or input format (default %(default)s)",
    "output": "file to write (default: standard output)",
    "reason": "why, for the audit trail",
    "name": "name, e.g. team-search or my-bert",
    "principal": "principal name or id",
    "role": "role: infer, trials:run, workloads:read, ledger:read or admin",
    "key_id": "the key's id, as `keys create` printed it (not the secret)",
    "price_key": "key into the price book, as the executor's Describe names it (e.g. cpu/cpu-2core)",
    "currency": "ISO 4217 currency code (default %(default)s)",
    "kind": "user, service or team (default %(default)s)",
    "team": "team the principal belongs to; usage is reported per team",
    "trial_id": "trial id, as `trial start` printed it",
    "workload": "workload id, as `workloads list` shows it",
    "description": "one line shown by `models list`",
    "allow_factory": "package whose factories may be imported (repeatable); others are refused",
    "action": "only rows of this action, e.g. route.set",
    "limit": "rows to show at most (default %(default)s)",
    "max_queue_delay_us": "microseconds a request may wait for others to batch with; 0 = only what "
    "queued while the device was busy (default %(default)s)",
    "max_queue_size": "requests queued per model before new ones get RESOURCE_EXHAUSTED "
    "(default %(default)s)",
    "max_message_mb": "largest gRPC message in or out, in MiB (default %(default)s)",
    "metrics_port": "Prometheus metrics port (GET /metrics; default $SWITCHYARD_METRICS_PORT, else 0 = any "
    "free port, logged; -1 = none)",
}

# command (as typed after `switchyard`) -> examples
EXAMPLES: dict[str, str] = {
    "executor": "switchyard executor serve --backend cpu --models mlp,tiny-lm\n"
    "switchyard executor describe --address 127.0.0.1:8101",
    "backends": "switchyard backends",
    "infer": "SWITCHYARD_API_KEY=sk_... switchyard infer --address 127.0.0.1:8001 --model mlp --input x.npy",
    "metering": "switchyard metering migrate --db postgresql+psycopg://u@db/switchyard\n"
    "switchyard metering serve --port 8201",
    "ledger": "switchyard ledger report --by path,model --since 2026-01-01\n"
    "switchyard ledger export --format focus -o focus.csv\nswitchyard ledger html -o ledger.html",
    "audit": "switchyard audit verify\nswitchyard audit query --action route.set --limit 20",
    "prices": "switchyard prices set cpu/cpu-2core 0.12 --currency USD --from 2027-01-01",
    "principals": "switchyard principals create team-search --kind team --team team-search",
    "keys": "switchyard keys create team-search --expires 2027-06-01\nswitchyard keys revoke KEY_ID",
    "roles": "switchyard roles grant team-search infer --scope model:mlp\n"
    "switchyard roles revoke team-search infer",
    "evaluator": "switchyard evaluator serve --port 8301",
    "router": "switchyard router serve --config routes.toml --metering 127.0.0.1:8201\n"
    "switchyard router routes\n"
    "switchyard router set-route mlp --policy weighted --target cpu:90 --target xla:10",
    "worker": "switchyard worker --temporal 127.0.0.1:7233 --executor cpu=127.0.0.1:8101",
    "trial": "switchyard trial start deploy/local/trials/tiny-lm-three-paths.json --wait\n"
    "switchyard trial report TRIAL_ID -o report.html",
    "demo": "switchyard demo --requests 300 --concurrency 8\nswitchyard demo --keep",
    "health": "switchyard health 127.0.0.1:8101 && echo serving",
    "models": "switchyard models list\nswitchyard models add my-bert ./my-bert\n"
    "switchyard models add my-llama ./my-llama --max-context 4096 --max-num-seqs 16\n"
    "switchyard models validate my-bert --backend xla",
    "workloads": "switchyard workloads list\nswitchyard workloads export WORKLOAD -o workload.jsonl",
    "up": "switchyard up\nswitchyard up status",
    "paths": "switchyard paths list",
}


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    return [
        (name, sub)
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, sub in action.choices.items()
    ]


def complete(parser: argparse.ArgumentParser, top: str = "") -> None:
    """Fills in missing option help and examples, recursively."""
    for action in parser._actions:
        if (
            action.help is None
            and not isinstance(action, argparse._SubParsersAction)
            and action.dest in COMMON
        ):
            text = COMMON[action.dest]
            if action.default in ("", None, [], False):  # nothing worth showing as a default
                text = text.replace(" (default %(default)s)", "").replace("; 0 = any free port", "")
            action.help = text
    for name, sub in _subparsers(parser):
        command = top or name
        if not sub.epilog and command in EXAMPLES:
            sub.epilog = "examples:\n" + "\n".join("  " + line for line in EXAMPLES[command].splitlines())
            sub.formatter_class = argparse.RawDescriptionHelpFormatter
        complete(sub, command)
