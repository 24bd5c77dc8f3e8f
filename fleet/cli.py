"""The ``fleet`` command line: thin commands over the library."""

from __future__ import annotations

import click


@click.group()
@click.version_option(package_name="fleet")
def main() -> None:
    """Provision and roll out vLLM serving fleets on NVIDIA GPU hosts."""


def _register_optional_groups() -> None:
    """Attach command groups that live in their own modules."""
    from fleet.lab.cli import lab

    main.add_command(lab)


try:
    _register_optional_groups()
except ImportError:  # pragma: no cover - the lab CLI module is added by its own issue
    pass
