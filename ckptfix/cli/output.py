"""What a command prints: its report as text, or as one JSON object with ``--json``.

Text never carries a control character to the terminal: each line is :func:`~ckptfix.core.units.escaped` (the
reports cap and escape the names they show; this is the net under them). JSON escapes control characters itself
and keeps every name exact."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

from ..core.units import escaped


def emit_json(obj: dict[str, Any]) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def render(report: Any, as_json: bool, text: Callable[[Any], str]) -> None:
    """``report.to_dict()`` as JSON with ``--json``, else ``text(report)``."""
    if as_json:
        emit_json(report.to_dict())
    else:
        click.echo("\n".join(map(escaped, text(report).split("\n"))))
