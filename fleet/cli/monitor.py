"""``fleet monitor``: Prometheus scrape targets and alert rules for what fleet deployed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from fleet.cli import console, fail
from fleet.errors import FleetError


@click.group()
def monitor() -> None:
    """Prometheus configuration and alert rules for the fleet."""


@monitor.command("export")
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--limit", multiple=True, help="Only these hosts or groups (repeatable; globs allowed).")
@click.option("--scrape-interval", default="15s", show_default=True, help="Prometheus scrape_interval.")
@click.option("--evaluation-interval", default="15s", show_default=True, help="Prometheus evaluation_interval.")
@click.option(
    "--node-exporter-port",
    type=int,
    default=9100,
    show_default=True,
    help="Port of node_exporter on every host (unit restarts); 0 leaves the job out.",
)
@click.option("--audit-exporter", help="HOST:PORT of the node_exporter whose textfile directory holds DIR/textfile/.")
@click.option(
    "--findings",
    type=click.Path(dir_okay=False, exists=True),
    help="JSON findings of the last audit, written to DIR/textfile/fleet_audit.prom.",
)
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def export(
    inventory: str,
    directory: Path,
    limit: tuple[str, ...],
    scrape_interval: str,
    evaluation_interval: str,
    node_exporter_port: int,
    audit_exporter: str | None,
    findings: str | None,
    as_json: bool,
) -> None:
    """Write DIR/prometheus.yml, DIR/targets/*.json and DIR/rules/*.yml from INVENTORY and its plan.

    Validate the result with `promtool check config DIR/prometheus.yml`.
    """
    from fleet.inventory.spec import load_inventory
    from fleet.monitor.export import ExportOptions, export_files
    from fleet.monitor.findings import load_findings
    from fleet.monitor.targets import targets_from_outcomes
    from fleet.monitor.thresholds import load_thresholds
    from fleet.plan.outcomes import plan_inventory
    from fleet.render.units import write_tree

    options = ExportOptions(scrape_interval, evaluation_interval, node_exporter_port or None, audit_exporter)
    if options.problems():
        fail("\n".join(options.problems()), as_json)
    try:
        loaded = load_inventory(inventory, list(limit) or None)
        thresholds = load_thresholds(loaded)
        outcomes = plan_inventory(loaded)
        targets = targets_from_outcomes(outcomes, loaded)
        found = load_findings(findings) if findings else None
        files = export_files(targets, thresholds, options, found, time.time(), inventory)
    except FleetError as exc:
        fail(str(exc), as_json)
    written = write_tree(directory, files)
    unplanned = [o.spec.name for o in outcomes if o.plan is None]
    if as_json:
        click.echo(
            json.dumps(
                {
                    "directory": str(directory),
                    "files": [str(p) for p in written],
                    "targets": [{"target": t.hostport, **t.labels()} for t in targets],
                    "hosts_without_plan": unplanned,
                },
                indent=2,
            )
        )
        return
    out = console()
    out.print(f"{len(targets)} instance targets on {len({t.host for t in targets})} hosts; files under {directory}/:")
    for path in written:
        out.print(f"  {path.relative_to(directory)}")
    if unplanned:
        out.print(f"[yellow]no plan (nothing to scrape):[/] {', '.join(unplanned)} — see `fleet plan {inventory}`")
    out.print(f"check: promtool check config {directory}/prometheus.yml")
