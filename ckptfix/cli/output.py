"""What a command prints: its report as text, or as one JSON object with ``--json``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click


def emit_json(obj: dict[str, Any]) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def render(report: Any, as_json: bool, text: Callable[[Any], str]) -> None:
    """``report.to_dict()`` as JSON with ``--json``, else ``text(report)``."""
    if as_json:
        emit_json(report.to_dict())
    else:
        click.echo(text(report))
