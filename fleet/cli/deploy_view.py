"""What ``fleet deploy`` (and ``fleet rollout INVENTORY``, which is a deploy) shows: the live step
of each host while it runs, and the result table or JSON after."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn, ParamSpec, TypeVar

import click
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from fleet.cli import console

if TYPE_CHECKING:
    from fleet.deploy.runner import DeployResult

P = ParamSpec("P")
T = TypeVar("T")


def report(result: DeployResult, as_json: bool, title: str) -> NoReturn:
    """The deploy's summary table (or JSON), then exit 0 (all healthy) or 1."""
    err = Console(stderr=True, highlight=False)
    if as_json:
        click.echo(json.dumps(result.data(), indent=2))
    else:
        table = Table(title=title)
        for col in ("host", "status", "operations", "reboot", "instances"):
            table.add_column(col)
        for h in result.hosts:
            needs = "required: " + ", ".join(h.reboot_required) if h.reboot_required is not None else ""
            healthy = sum(e.healthy for e in h.endpoints)
            instances = f"{healthy}/{len(h.endpoints)} healthy" if h.endpoints else ""
            ops = "\n".join(h.operations)
            for extra in (h.error, h.note):
                if extra:
                    ops = (ops + "\n" if ops else "") + extra
            table.add_row(escape(h.host), h.status, escape(ops), needs, instances)
        console().print(table)
        if result.error:
            err.print(f"[red]{escape(result.error)}[/]")
        err.print(f"{result.seconds:.1f} s")
    sys.exit(0 if result.ok else 1)


class HostSteps:
    """Live progress: the step each host is on (a live table on a terminal, else one line per step)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.steps: dict[str, str] = {}
        self.live = Live(console=console, auto_refresh=False, transient=True) if console.is_terminal else None

    def _table(self) -> Table:
        table = Table(show_header=False, box=None)
        for host, text in self.steps.items():
            table.add_row(escape(host), escape(text))
        return table

    def step(self, host: str, text: str) -> None:
        self.steps[host] = text
        if self.live is not None:
            self.live.update(self._table(), refresh=True)
        else:
            self.console.print(f"[dim]{escape(host)}: {escape(text)}[/]")

    def paused(self, f: Callable[P, T]) -> Callable[P, T]:
        """``f`` with this live view stopped while it runs (it shows its own)."""

        def run(*args: P.args, **kwargs: P.kwargs) -> T:
            if self.live is not None:
                self.live.stop()
            try:
                return f(*args, **kwargs)
            finally:
                if self.live is not None:
                    self.live.start()

        return run

    def note(self, text: str) -> None:
        if self.live is None:
            self.console.print(f"[dim]{escape(text)}[/]")

    def __enter__(self) -> HostSteps:
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.live is not None:
            self.live.stop()
