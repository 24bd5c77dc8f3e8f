"""``fleet audit``: GPU, NVLink, PCIe, driver and health facts of every host, judged."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fleet.audit.findings import Severity
from fleet.audit.run import MultiNode, judge, plan_multi_node, probe, probe_acs, probe_multi_node, probe_watch
from fleet.cli import console, fail
from fleet.errors import FleetError
from fleet.facts.runner import HostUnreachable, targets_from_inventory
from fleet.inventory.spec import load_inventory
from fleet.localfs import atomic_write


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--limit", multiple=True, help="Only these hosts or groups (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--html", "html_file", type=click.Path(dir_okay=False), help="Write a self-contained HTML report.")
@click.option(
    "--fail-on",
    default="error",
    show_default=True,
    type=click.Choice([s.label for s in Severity]),
    help="Exit non-zero when a finding is at or above this severity.",
)
@click.option(
    "--python",
    help="Python 3.6+ on the hosts that runs the probe (default: fleet's venv, else python3); it needs no "
    "packages: the probe carries its pynvml.",
)
@click.option("--timeout", default=60.0, show_default=True, help="Seconds per host.")
def audit(
    inventory: str,
    limit: tuple[str, ...],
    as_json: bool,
    html_file: str | None,
    fail_on: str,
    python: str | None,
    timeout: float,
) -> None:
    """Probe every host's GPUs through NVML and check them against their model and their peers.

    Also reads, as root (sudo -n) and without changing anything, the PCIe ACS setting of the
    bridges between each host's GPUs: redirection there makes GPU peer-to-peer crawl or hang;
    and the GPU watcher's record: a quarantined GPU is an error (`fleet gpu clear` lifts it).

    For each instance the plan spreads over several hosts (multi_node groups), also: the same
    driver, vLLM release and GPUs on all its nodes, each worker's TCP connect to the leader's
    rendezvous port, an ACTIVE RDMA port on every node (else: traffic goes over TCP, and what
    that costs), and one MTU towards the leader.

    Exit code 0 when no finding reaches --fail-on, 1 when one does, 2 on bad input.
    """
    try:
        loaded = load_inventory(inventory, list(limit) or None)
        targets_from_inventory(loaded.pyinfra, [h.name for h in loaded.hosts])  # SSH settings checked up front
    except FleetError as exc:
        fail(str(exc), as_json)
    if html_file and not Path(html_file).absolute().parent.is_dir():
        fail(f"--html {html_file}: no directory {Path(html_file).absolute().parent} to write the report in: "
             "create it or name a file in one that exists (no host was probed)", as_json)  # fmt: skip
    started = time.monotonic()
    if as_json:
        results = probe(loaded, python=python, timeout=timeout)
    else:
        err = Console(stderr=True, highlight=False)
        with Progress(
            TextColumn("probing"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
            TimeElapsedColumn(), console=err, transient=True,
        ) as bar:  # fmt: skip
            task = bar.add_task("", total=len(loaded.hosts))

            def progress(host: str, result: object) -> None:
                mark = "unreachable" if isinstance(result, HostUnreachable) else "ok"
                bar.update(task, advance=1, description=f"{host} {mark}")

            results = probe(loaded, progress=progress, python=python, timeout=timeout)
    acs = probe_acs(loaded, timeout=timeout)
    watch = probe_watch(loaded, timeout=timeout)
    spanning = None
    instances, unplanned = plan_multi_node(loaded, results)
    if instances or unplanned:
        releases, net = probe_multi_node(loaded, instances, timeout=timeout)
        spanning = MultiNode(instances, unplanned, releases, net)
    report = judge(loaded, results, time.monotonic() - started, acs=acs, watch=watch, spanning=spanning)
    if html_file:
        try:
            atomic_write(html_file, report.to_html())
        except OSError as exc:
            fail(f"--html {html_file}: cannot write the report: {exc.strerror or exc}; name a writable file", as_json)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        report.print(console())
        if html_file:
            console().print(f"HTML report: {html_file}")
    raise SystemExit(1 if report.failed(Severity.parse(fail_on)) else 0)
