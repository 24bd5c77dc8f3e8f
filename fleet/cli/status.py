"""``fleet status``: per instance, what it is doing now (health, KV cache, queue, latency)."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING

import click
from rich.console import Group
from rich.live import Live
from rich.text import Text

from fleet.cli import console, fail
from fleet.cli.status_view import status_view
from fleet.errors import FleetError

if TYPE_CHECKING:
    from fleet.inventory.spec import LoadedInventory
    from fleet.lb.traffic import Traffic
    from fleet.monitor.targets import Target


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--limit", multiple=True, help="Only these hosts or groups (repeatable; globs allowed).")
@click.option("--interval", type=click.FloatRange(0.2, 600), default=2.0, show_default=True,
              help="Seconds between the two scrapes that rates and percentiles come from.")  # fmt: skip
@click.option("--timeout", type=click.FloatRange(0.1, 120), default=3.0, show_default=True, help="Per request.")
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until Ctrl-C.")
@click.option("--ssh/--no-ssh", default=True, show_default=True,
              help="Also read systemd units, the release and NVML over SSH (one round trip per host).")  # fmt: skip
@click.option("--wide", "-w", is_flag=True,
              help="Every column (vLLM, KV cache, preemptions, req/s, TTFT, e2e, unit, restarts, release, "
                   "GPU memory): one table at about 200 columns; on a narrower terminal the rest continue "
                   "in further tables, each led by host, instance and state. The default fits 80.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def status(
    inventory: str,
    limit: tuple[str, ...],
    interval: float,
    timeout: float,
    watch: bool,
    ssh: bool,
    wide: bool,
    as_json: bool,
) -> None:
    """What every planned vLLM instance is doing now: /health, /version and two /metrics scrapes
    over HTTP and, at the same time, over SSH: unit state, uptime and restarts (systemd), the
    release, and GPU memory in use (NVML).

    By default one row per instance (host, instance, state, model, requests running/waiting) that
    fits 80 columns, and under it why each instance that needs a look is not fine; --wide shows
    every column. Under them, what each host's model cache holds (hosts holding the same on one
    line; --wide: a line per host), read in the same SSH round.

    A host drained for maintenance (`fleet drain`) shows its instances as `drained`, with who,
    when and why under the table; --wide's `lb` column is what each instance's load balancer says
    (UP/DRAIN/MAINT/DOWN and its current sessions; with --no-ssh only balancers on this machine are
    asked).

    Exit status 1 when an instance is not ready (and not drained), its unit is not active, its host
    is unreachable, it serves but is held out of its balancer's traffic, or it breaks an alert
    threshold; 2 when the inventory is invalid.
    """
    from fleet.inventory.spec import load_inventory
    from fleet.monitor.hoststate import observe, ssh_targets
    from fleet.monitor.status import status_data
    from fleet.monitor.targets import targets_from_outcomes
    from fleet.monitor.thresholds import load_thresholds
    from fleet.plan.outcomes import build_fleet_plan

    try:
        loaded = load_inventory(inventory, list(limit) or None)
        thresholds = load_thresholds(loaded)
        outcomes = build_fleet_plan(loaded).outcomes  # the fleet plan from the inventory's gpu data
        targets = targets_from_outcomes(outcomes, loaded)
        hosts = ssh_targets(loaded.pyinfra, targets) if ssh else []
        traffic = _traffic(loaded, targets, ssh)
    except FleetError as exc:
        fail(str(exc), as_json)
    unplanned = [o.spec.name for o in outcomes if o.plan is None]
    if not targets:
        fail(f"{inventory}: no host has a serving plan, so there is nothing to observe (see `fleet plan`)", as_json)
    if watch and as_json:
        fail("--watch is for people; use --json without it (or call it in a loop)", as_json)
    if watch:
        out = console()
        rows, latest, held = observe(targets, hosts, thresholds, interval, timeout, traffic=traffic)
        try:
            with Live(status_view(rows, interval, wide, held), console=out, auto_refresh=False) as live:
                while True:
                    time.sleep(interval)
                    rows, latest, held = observe(
                        targets, hosts, thresholds, interval, timeout, previous=latest, traffic=traffic
                    )
                    stamp = Text(time.strftime("%H:%M:%S") + "  Ctrl-C to stop", style="dim")
                    live.update(Group(status_view(rows, interval, wide, held), stamp), refresh=True)
        except KeyboardInterrupt:
            return
    try:
        rows, _, held = observe(targets, hosts, thresholds, interval, timeout, traffic=traffic)
    finally:
        if traffic is not None:
            traffic.close()
    if as_json:
        data = {
            "instances": [status_data(r) for r in rows],
            "hosts_without_plan": unplanned,
            "hosts": [m.data() for m in held.values()],  # what each host's cache holds (empty: --no-ssh)
        }
        click.echo(json.dumps(data, indent=2))
    else:
        console().print(status_view(rows, interval, wide, held))
        if unplanned:
            console().print(f"[yellow]not observed (no valid plan, so no instances):[/] {', '.join(unplanned)}")
    sys.exit(0 if all(r.ok for r in rows) and not unplanned else 1)


def _traffic(loaded: LoadedInventory, targets: list[Target], ssh: bool) -> Traffic | None:
    """The balancers in front of the targets (without SSH: only those on this machine)."""
    from fleet.lb.traffic import Traffic, traffic_of

    served = {(t.host, f"vllm-{t.index}"): t.model for t in targets}
    traffic = traffic_of(loaded, list(served), served=served)
    if not ssh:
        traffic = Traffic({k: v for k, v in traffic.seats.items() if v.balancer.spec.local})
    return traffic or None
