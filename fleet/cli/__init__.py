"""The ``fleet`` command line: thin commands over the library, one module per verb."""

from __future__ import annotations

import json
import sys
from typing import NoReturn

import click
from rich.console import Console


def console() -> Console:
    return Console(stderr=False, highlight=False)


@click.group()
@click.version_option(package_name="fleet")
def main() -> None:
    """Provision and roll out vLLM serving fleets on NVIDIA GPU hosts."""


def fail(message: str, as_json: bool, code: int = 2) -> NoReturn:
    if as_json:
        click.echo(json.dumps({"error": message}, indent=2))
    else:
        Console(stderr=True, highlight=False).print(f"[bold red]error:[/] {message}")
    sys.exit(code)


def _register_commands() -> None:
    """Attach the commands, one module per verb (imported late: they import the library)."""
    from fleet.cli.lab import lab
    from fleet.cli.monitor import monitor
    from fleet.cli.plan import plan
    from fleet.cli.status import status

    main.add_command(plan)
    main.add_command(lab)
    main.add_command(monitor)
    main.add_command(status)


_register_commands()
