"""CLI commands of this component (placeholder until the component lands)."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: argparse._SubParsersAction[Any]) -> None:
    """Adds this component's subcommands; none yet."""
