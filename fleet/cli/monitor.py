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
    from fleet.monitor.export import ExportOptions, export_files
    from fleet.monitor.findings import load_findings
    from fleet.monitor.targets import scrape_warnings, targets_from_outcomes
    from fleet.monitor.thresholds import load_thresholds
    from fleet.plan.outcomes import build_fleet_plan, load_for_planning
    from fleet.render.units import write_tree

    options = ExportOptions(scrape_interval, evaluation_interval, node_exporter_port or None, audit_exporter)
    if options.problems():
        fail("\n".join(options.problems()), as_json)
    try:
        loaded = load_for_planning(inventory, list(limit) or None)
        thresholds = load_thresholds(loaded)
        outcomes = build_fleet_plan(loaded).outcomes
        targets = targets_from_outcomes(outcomes, loaded)
        found = load_findings(findings) if findings else None
        files = export_files(targets, thresholds, options, found, time.time(), inventory)
    except FleetError as exc:
        fail(str(exc), as_json)
    written = write_tree(directory, files)
    unplanned = [o.spec.name for o in outcomes if o.plan is None]
    warnings = scrape_warnings(outcomes)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "directory": str(directory),
                    "files": [str(p) for p in written],
                    "targets": [{"target": t.hostport, **t.labels()} for t in targets],
                    "hosts_without_plan": unplanned,
                    "warnings": warnings,
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
    for warning in warnings:
        out.print(f"[yellow]warning:[/] {warning}")
    out.print(f"check: promtool check config {directory}/prometheus.yml")


# -- observed workload (also behind `fleet plan --observed`) -----------------------------------------------


def print_observed(inventory: str, limit: tuple[str, ...], prometheus: str | None, window: str, seconds: float,
                   as_json: bool) -> None:  # fmt: skip
    """Observe the serving instances, show the workload next to the declared one, re-plan, print the diff."""
    from rich.table import Table

    from fleet.monitor.observed import observe_http, observe_prometheus, replan, report_data
    from fleet.monitor.targets import targets_from_outcomes
    from fleet.monitor.thresholds import is_duration
    from fleet.plan.outcomes import build_fleet_plan, load_for_planning

    if prometheus is not None and not prometheus.startswith(("http://", "https://")):
        fail(f"--prometheus={prometheus!r}: a URL like http://prometheus.internal:9090", as_json)
    if not is_duration(window):
        fail(f"--window={window!r}: a Prometheus duration like 1h or 7d", as_json)
    try:
        loaded = load_for_planning(inventory, list(limit) or None)
        if prometheus:
            versions = {s.vllm_version for s in loaded.hosts}
            observed = {}
            for version in sorted(versions):
                hosts = [s.name for s in loaded.hosts if s.vllm_version == version]
                observed.update(observe_prometheus(prometheus, hosts, window, version))
        else:
            targets = targets_from_outcomes(build_fleet_plan(loaded).outcomes, loaded)
            observed = observe_http(targets, seconds=seconds)
        reports = replan(loaded, observed)
    except FleetError as exc:
        fail(str(exc), as_json)
    if as_json:
        click.echo(json.dumps({"hosts": [report_data(r) for r in reports]}, indent=2))
        return
    out = console()
    for r in reports:
        o = r.observed
        if o is None:
            out.print(f"[bold]{r.host}[/]: [yellow]{r.problem}[/]")
            continue
        table = Table(title=f"{r.host}: observed workload ({o.requests:g} requests; {o.source})", header_style="bold")
        for col in ("", "declared", "observed", "bucket (resolution)", "suggested"):
            table.add_column(col)
        for label, key, q in (
            ("p95 input tokens", "p95_input_tokens", o.p95_input),
            ("p95 output tokens", "p95_output_tokens", o.p95_output),
        ):
            shown = "-" if q is None or q.value is None else f"{q.value:.0f}"
            bucket = "-" if q is None or q.value is None else f"({q.lower:g}, {q.upper:g}]"
            table.add_row(label, str(getattr(r.declared, key)), shown, bucket, str(getattr(r.suggested, key)))
        reuse = "-" if o.prefix_reuse is None else f"{o.prefix_reuse:.2f}"
        table.add_row("prefix reuse", f"{r.declared.prefix_reuse:g}", reuse, "", f"{r.suggested.prefix_reuse:g}")
        peak = "-" if o.peak_concurrency is None else f"{o.peak_concurrency:g} (peak)"
        table.add_row("concurrency", str(r.declared.target_concurrency), peak, "", str(r.suggested.target_concurrency))
        out.print(table)
        for note in o.notes:
            out.print(f"  [yellow]note:[/] {note}")
        if r.change:
            out.print("  suggested inventory change (host data):")
            body = ", ".join(f"{k!r}: {b!r}" for k, (_, b) in r.change.items())
            out.print(f"    workload = {{..., {body}}}", markup=False)
        else:
            out.print("  the declared workload matches what is served")
        for line in r.plan_diff or (["plan unchanged"] if r.change else []):
            out.print(f"  plan: {line}", markup=False)


@monitor.command("observe")
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--limit", multiple=True, help="Only these hosts or groups (repeatable; globs allowed).")
@click.option("--prometheus", help="Read from this Prometheus (job fleet-vllm) instead of the instances.")
@click.option("--window", default="7d", show_default=True, help="With --prometheus: how far back.")
@click.option("--seconds", type=click.FloatRange(0, 3600), default=10.0, show_default=True,
              help="Without --prometheus: how long to sample the instances for peak concurrency.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the reports as JSON.")
def observe(inventory: str, limit: tuple[str, ...], prometheus: str | None, window: str, seconds: float,
            as_json: bool) -> None:  # fmt: skip
    """The workload each host really serves, next to the declared one, and the plan it would give."""
    print_observed(inventory, limit, prometheus, window, seconds, as_json)
