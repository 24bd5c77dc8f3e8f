"""``fleet stage``: the inventory's model on every host that names a ``model_source``, verified.

A thin command over ``fleet.weights.stage``: live progress per host for people (bytes, rate,
ETA; rich's progress bars on a terminal, a line per host otherwise), a table or ``--json`` after.
"""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from fleet.cli import EXIT_OK, EXIT_SOME_HOSTS, console, fail
from fleet.errors import FleetError


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--limit", multiple=True, help="Only these hosts or groups (repeatable; globs allowed).")
@click.option(
    "--parallel", type=click.IntRange(1, 1024), default=None,
    help="Hosts copied at once [default: 4; with --fanout the inventory's staging.concurrency].",
)  # fmt: skip
@click.option(
    "--fanout", is_flag=True,
    help="Hosts holding a verified copy send it on to the next ones (a tree), directly host to host on "
    "the inventory's staging port, each sender at its staging.egress_mib_s.",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def stage(inventory: str, limit: tuple[str, ...], parallel: int | None, fanout: bool, as_json: bool) -> None:
    """Copy the model's weights from the inventory's model_source to each host and verify them.

    A hub source (a mirror laid out like the Hugging Face Hub) is read by this machine only: the
    revision resolved to a commit, every file checked against the mirror's own metadata (LFS
    SHA-256, git blob ids) into model_source.cache_dir, then sent on like a directory source.

    Each host's copy is checked against the source's manifest (size and SHA-256 of every file);
    what is missing, truncated or corrupted is sent again; refs/main names the snapshot only once
    it verifies. Exit status 1 when a host was refused or failed, 2 when the input is invalid.

    With --fanout each round every host that holds the model (and this machine) sends it to at most
    one more host, at most staging.concurrency at once (and --parallel), so n hosts take about
    log2(n+1) rounds; a sender that fails mid-copy keeps serving and is named, its receiver is
    given another sender. This machine sends at the smallest staging.egress_mib_s of the hosts.
    """
    from fleet.inventory.spec import load_inventory
    from fleet.weights.stage import describe, jobs_for, manifests_for
    from fleet.weights.stage import stage_all as run_stage

    try:
        loaded = load_inventory(inventory, list(limit) or None)
        jobs = jobs_for(loaded)
        if not jobs:
            raise FleetError(
                f"{inventory}: no selected host names a model_source or lora_adapters: add model_source: "
                "{kind: dir, path: /srv/models} (a directory on this machine holding ORG/NAME/) or "
                "{kind: hub, endpoint: https://...} (a mirror laid out like the Hugging Face Hub) to its data"
            )
        err = Console(stderr=True, highlight=False)
        if not as_json:
            err.print(f"[dim]manifest of {len({(j.source, j.model) for j in jobs})} model(s) (hashed once, cached)[/]")
        manifests = manifests_for(jobs, note=lambda text: None if as_json else err.print(f"[dim]{escape(text)}[/]"))
    except FleetError as exc:
        fail(str(exc), as_json)
    bars = Progress(
        TextColumn("{task.fields[host]}"), TextColumn("{task.fields[what]}"), BarColumn(), DownloadColumn(),
        TransferSpeedColumn(), TimeRemainingColumn(), console=err, disable=as_json or not err.is_terminal,
    )  # fmt: skip
    tasks: dict[str, TaskID] = {}
    for j in jobs:
        if j.target.name in tasks:  # its adapters after its model: one bar per host
            continue
        tasks[j.target.name] = bars.add_task("", total=None, host=j.target.name, what="waiting")

    def progress(host: str, what: str, done: int, total: int) -> None:
        bars.update(tasks[host], completed=done, total=total or None, what=what)
        if not as_json and not err.is_terminal and what not in ("sending",):
            err.print(f"[dim]{escape(host)}: {escape(what)}[/]")

    extra: dict[str, object] = {}
    fan = None
    with bars:
        if fanout:
            from fleet.deploy.staging import fanout_limits
            from fleet.weights.fanout import fan_out

            staging = {s.name: s.staging for s in loaded.hosts}
            source_egress, concurrency = fanout_limits(staging.values(), parallel)
            try:
                fan = fan_out(
                    jobs, staging, manifests, progress=progress, source_egress=source_egress, concurrency=concurrency
                )
            except FleetError as exc:
                fail(str(exc), as_json)
            results = fan.results
            extra = {"rounds": fan.rounds, "bounds": fan.bounds, "broken_senders": fan.broken}
        else:
            results = run_stage(jobs, parallel=parallel or 4, progress=progress, manifests=manifests)
    ok = all(r.ok for r in results.values())
    if as_json:
        click.echo(json.dumps({"ok": ok, "hosts": [r.data() for r in results.values()], **extra}, indent=2))
    else:
        table = Table(title="fleet stage")
        for col in ("host", "status", "detail"):
            table.add_column(col)
        for r in results.values():
            table.add_row(escape(r.host), r.status, escape(describe(r)))
        console().print(table)
        for n, sends in enumerate(fan.rounds if fan is not None else [], 1):
            pairs = ", ".join(f"{escape(s['from'])} -> {escape(s['to'])} ({s['status']})" for s in sends)
            console().print(f"round {n}: {pairs}")
        for b in fan.broken if fan is not None else []:
            console().print(f"[yellow]{escape(b)} failed while sending; it keeps serving its copy[/]")
    sys.exit(EXIT_OK if ok else EXIT_SOME_HOSTS)
