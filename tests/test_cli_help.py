"""Every option of `switchyard` has help, numbers say their unit, and every command has examples."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

from clients.cli import build_parser

# words that say what a number counts or measures
UNITS = re.compile(
    r"\b(seconds?|s|ms|microseconds|us|µs|bytes|KiB|MiB|MB|GiB|port|count|number|requests?|rows|"
    r"events|clients|iterations|steps|in flight|at once|share|fraction|threads|per|%)\b",
    re.IGNORECASE,
)


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _commands(sub, (*path, name))


def _options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        if not isinstance(
            action, argparse._SubParsersAction | argparse._HelpAction | argparse._VersionAction
        ):
            yield action


def test_every_option_has_help_and_numbers_their_unit() -> None:
    missing, unitless = [], []
    for path, parser in _commands(build_parser()):
        for action in _options(parser):
            where = f"switchyard {' '.join(path)} {'/'.join(action.option_strings) or action.dest}"
            if not action.help:
                missing.append(where)
            elif action.type in (int, float) and not UNITS.search(action.help):
                unitless.append(f"{where}: {action.help}")
    assert missing == []
    assert unitless == []


def test_every_command_has_examples() -> None:
    without = [
        " ".join(path)
        for path, parser in _commands(build_parser())
        if "example" not in (parser.epilog or "") and "switchyard" not in (parser.epilog or "")
    ]
    assert without == []


def test_version() -> None:
    parser = build_parser()
    try:
        parser.parse_args(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
