"""``python -m fleet.cli``: the same as the ``fleet`` command."""

from fleet.cli import run

run()
