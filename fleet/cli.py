"""The ``fleet`` command line: thin commands over the library."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NoReturn

import click
from rich.console import Console

from fleet.errors import FleetError


def _console() -> Console:
    return Console(stderr=False, highlight=False)


@click.group()
@click.version_option(package_name="fleet")
def main() -> None:
    """Provision and roll out vLLM serving fleets on NVIDIA GPU hosts."""


@main.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--limit", multiple=True, help="Only these hosts or groups (repeatable; globs allowed).")
@click.option("--json", "as_json", is_flag=True, help="Print the plans as JSON.")
@click.option(
    "--render",
    "render_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write each host's systemd units and env files under DIR/<host>/.",
)
def plan(inventory: str, limit: tuple[str, ...], as_json: bool, render_dir: Path | None) -> None:
    """The serving plan per host: flags, memory math and reasons. Touches no host.

    Exit status 1 when any host has no valid plan, 2 when the inventory itself is invalid.
    """
    from fleet.plan import outcome_data, plan_file
    from fleet.render import render_host, write_tree
    from fleet.views import print_plans

    try:
        outcomes = plan_file(inventory, list(limit) or None)
    except FleetError as exc:
        _fail(str(exc), as_json)
    if render_dir is not None:
        for outcome in outcomes:
            if outcome.plan is not None:
                ref = str(outcome.spec.api_key_ref) if outcome.spec.api_key_ref else None
                write_tree(render_dir / outcome.spec.name, render_host(outcome.plan, None, ref))
    if as_json:
        click.echo(json.dumps({"hosts": [outcome_data(o) for o in outcomes]}, indent=2))
    else:
        print_plans(_console(), outcomes)
        if render_dir is not None:
            _console().print(f"units and env files written under {render_dir}/<host>/")
    sys.exit(0 if all(o.ok for o in outcomes) else 1)


def _fail(message: str, as_json: bool, code: int = 2) -> NoReturn:
    if as_json:
        click.echo(json.dumps({"error": message}, indent=2))
    else:
        Console(stderr=True, highlight=False).print(f"[bold red]error:[/] {message}")
    sys.exit(code)


def _register_optional_groups() -> None:
    """Attach command groups that live in their own modules."""
    import importlib.util

    if importlib.util.find_spec("fleet.lab.cli") is None:  # the lab ships in its own issue
        return
    from fleet.lab.cli import lab

    main.add_command(lab)


_register_optional_groups()


if __name__ == "__main__":  # python -m fleet.cli
    main()
