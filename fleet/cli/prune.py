"""``fleet prune``: remove the models a host's cache holds that nothing planned or kept uses.

A thin command over ``fleet.weights.prune``: without ``--yes`` it only lists, per host, what it
would remove and what it keeps (and why); with ``--yes`` it removes. A table for people, ``--json``.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import click
from rich.markup import escape
from rich.table import Table

from fleet.cli import EXIT_OK, EXIT_SOME_HOSTS, console, fail
from fleet.errors import FleetError


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--limit", multiple=True, help="Only these hosts or groups (repeatable; globs allowed).")
@click.option("--yes", is_flag=True, help="Remove them (without it, only list what would be removed).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def prune(inventory: str, limit: tuple[str, ...], yes: bool, as_json: bool) -> None:
    """Remove models no planned instance and no kept configuration revision uses.

    A model in a host's cache is kept when the inventory plans it there (model, speculative draft,
    LoRA adapters), when a fleet unit or a stored configuration revision names it (a rollback may
    serve it again), or while a copy is being staged into it. Exit status 1 when a host could not
    be listed or pruned, 2 when the input is invalid.
    """
    from fleet.facts.sshlink import SshTarget
    from fleet.inventory.spec import load_inventory
    from fleet.weights.prune import planned_models, prune_host
    from fleet.weights.stage import hub_dir
    from fleet.weights.verify import fmt_bytes

    try:
        loaded = load_inventory(inventory, list(limit) or None)
        jobs = []
        for spec in loaded.hosts:
            data = loaded.pyinfra.get_host(spec.name).data.dict()  # type: ignore[no-untyped-call]
            jobs.append((SshTarget.from_data(spec.name, data), planned_models(spec)))
    except FleetError as exc:
        fail(str(exc), as_json)
    hub = hub_dir("/var/lib/vllm")
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(jobs)))) as pool:
        results = list(pool.map(lambda job: prune_host(job[0], hub, job[1], yes), jobs))
    ok = all(r.ok for r in results)
    if as_json:
        click.echo(json.dumps({"ok": ok, "applied": yes, "hosts": [r.data() for r in results]}, indent=2))
        sys.exit(EXIT_OK if ok else EXIT_SOME_HOSTS)
    table = Table(title="fleet prune" + ("" if yes else " (nothing removed: --yes removes)"))
    for col in ("host", "model folder", "size", "verdict"):
        table.add_column(col)
    for r in results:
        if r.error:
            table.add_row(escape(r.host), "-", "-", f"[red]{escape(r.error)}[/]")
        for v in r.verdicts:
            verdict = ("[green]removed[/]" if v.folder in r.removed else "[yellow]would remove[/]") if v.pruned else (
                f"kept: {escape(v.why)}")  # fmt: skip
            table.add_row(escape(r.host), escape(v.folder), fmt_bytes(v.bytes), verdict)
    out = console()
    out.print(table)
    total = sum(v.bytes for r in results for v in r.verdicts if v.pruned and (v.folder in r.removed or not yes))
    out.print(f"{'freed' if yes else 'would free'} {fmt_bytes(total)}")
    sys.exit(EXIT_OK if ok else EXIT_SOME_HOSTS)
