"""``fleet status``: per instance, what it is doing now (health, KV cache, queue, latency)."""

from __future__ import annotations

import json
import math
import sys
import time
from typing import TYPE_CHECKING

import click
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from fleet.cli import console, fail
from fleet.errors import FleetError
from fleet.monitor.histograms import Quantile
from fleet.monitor.status import Health, InstanceStatus

if TYPE_CHECKING:
    from fleet.inventory.spec import LoadedInventory
    from fleet.lb.traffic import Traffic
    from fleet.monitor.targets import Target


def _q(q: Quantile | None) -> str:
    if q is None or q.value is None:
        return "-"
    return f">{q.lower:g}" if math.isinf(q.upper) else f"{q.value:.2f}"


def _pair(a: Quantile | None, b: Quantile | None) -> str:
    if (a is None or a.value is None) and (b is None or b.value is None):
        return "-"
    return f"{_q(a)}/{_q(b)}s"


def _num(v: float | None, fmt: str = "{:g}") -> str:
    return "-" if v is None else fmt.format(v)


def _red_if(text: str, row: InstanceStatus, word: str) -> Text:
    return Text(text, style="red" if any(word in p for p in row.problems) else "")


def _notes(row: InstanceStatus) -> Text:
    if row.drained is not None:
        return Text("; ".join([row.drained.describe(), *row.problems]), style="yellow")
    if row.health is not Health.READY:
        return Text("; ".join([row.detail, *row.problems]), style="red")
    return Text("; ".join(row.problems) or "ok", style="yellow" if row.problems else "green")


def _uptime(seconds: float | None) -> str:
    if seconds is None:
        return ""
    s = int(seconds)
    if s < 3600:
        return f" {s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f" {s // 3600}h{s % 3600 // 60:02d}m"
    return f" {s // 86400}d{s % 86400 // 3600:02d}h"


def _unit_cell(row: InstanceStatus) -> Text:
    unit = row.unit
    if unit is None:
        return Text("n/a", style="dim")
    style = "green" if unit.active else "red"
    return Text(unit.state + _uptime(unit.uptime_seconds), style=style)


def _release_cell(row: InstanceStatus) -> str:
    unit = row.unit
    if unit is None or unit.release is None:
        return "-"
    return unit.release


def _health_cell(row: InstanceStatus) -> Text:
    if row.drained is not None:
        return Text("drained", style="yellow")
    return Text(row.health.value, style="green" if row.health is Health.READY else "red")


def _lb_cell(row: InstanceStatus) -> Text:
    """The balancer's view: UP/DRAIN/MAINT/DOWN and its sessions ("-": no balancer in front)."""
    if row.lb_error:
        return Text("?", style="red")
    if row.lb is None:
        return Text("-", style="dim")
    style = "green" if row.lb.view == "UP" and row.lb.in_traffic else "yellow"
    return Text(f"{row.lb.view} {row.lb.sessions}", style=style)


def status_table(rows: list[InstanceStatus], interval: float) -> Table:
    table = Table(title=f"fleet status (rates over the last {interval:g}s)", header_style="bold")
    for col in ("host", "inst", "model", "health", "lb", "vLLM", "KV", "run/wait", "preempt", "req/s",
                "TTFT p50/p99", "e2e p50/p99", "unit", "restarts", "release", "GPU mem"):  # fmt: skip
        table.add_column(col, no_wrap=col not in ("host", "model", "release"))
    table.add_column("notes", overflow="fold")
    for row in rows:
        t, iv = row.target, row.interval
        ratio = iv.preemptions_per_request if iv else None
        unit = row.unit
        gpu = unit.gpu_memory_used if unit else None
        table.add_row(
            t.host,
            str(t.index),
            t.model,
            _health_cell(row),
            _lb_cell(row),
            row.version or "-",
            _red_if(_num(row.kv_usage, "{:.0%}"), row, "KV"),
            _red_if(f"{_num(row.running)}/{_num(row.waiting)}", row, "waiting"),
            _red_if("-" if ratio is None else ("inf" if math.isinf(ratio) else f"{ratio:.1%}"), row, "preemptions"),
            _num(iv.requests_per_second if iv else None, "{:.1f}"),
            _red_if(_pair(iv.ttft_p50, iv.ttft_p99) if iv else "-", row, "TTFT"),
            _red_if(_pair(iv.e2e_p50, iv.e2e_p99) if iv else "-", row, "e2e"),
            _unit_cell(row),
            _red_if(_num(unit.restarts if unit else None), row, "restarted"),
            _release_cell(row),
            Text("n/a", style="dim") if gpu is None else f"{gpu / 2**30:.1f} GiB",
            _notes(row),
        )
    if any(r.unit is None for r in rows):
        table.caption = "unit and GPU mem: n/a without SSH facts (--no-ssh)"
    return table


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--limit", multiple=True, help="Only these hosts or groups (repeatable; globs allowed).")
@click.option("--interval", type=click.FloatRange(0.2, 600), default=2.0, show_default=True,
              help="Seconds between the two scrapes that rates and percentiles come from.")  # fmt: skip
@click.option("--timeout", type=click.FloatRange(0.1, 120), default=3.0, show_default=True, help="Per request.")
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until Ctrl-C.")
@click.option("--ssh/--no-ssh", default=True, show_default=True,
              help="Also read systemd units, the release and NVML over SSH (one round trip per host).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def status(
    inventory: str, limit: tuple[str, ...], interval: float, timeout: float, watch: bool, ssh: bool, as_json: bool
) -> None:
    """What every planned vLLM instance is doing now: /health, /version and two /metrics scrapes
    over HTTP and, at the same time, over SSH: unit state, uptime and restarts (systemd), the
    release, and GPU memory in use (NVML).

    A host drained for maintenance (`fleet drain`) shows its instances as `drained` with who,
    when and why; the `lb` column is what each instance's load balancer says (UP/DRAIN/MAINT/DOWN
    and its current sessions; with --no-ssh only balancers on this machine are asked).

    Exit status 1 when an instance is not ready (and not drained), its unit is not active, its host
    is unreachable, it serves but is left out of its balancer's traffic, or it breaks an alert
    threshold; 2 when the inventory is invalid.
    """
    from fleet.inventory.spec import load_inventory
    from fleet.monitor.hoststate import observe, ssh_targets
    from fleet.monitor.status import status_data
    from fleet.monitor.targets import targets_from_outcomes
    from fleet.monitor.thresholds import load_thresholds
    from fleet.plan.outcomes import plan_inventory

    try:
        loaded = load_inventory(inventory, list(limit) or None)
        thresholds = load_thresholds(loaded)
        outcomes = plan_inventory(loaded)
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
        rows, latest = observe(targets, hosts, thresholds, interval, timeout, traffic=traffic)
        try:
            with Live(status_table(rows, interval), console=out, auto_refresh=False) as live:
                while True:
                    time.sleep(interval)
                    rows, latest = observe(
                        targets, hosts, thresholds, interval, timeout, previous=latest, traffic=traffic
                    )
                    stamp = Text(time.strftime("%H:%M:%S") + "  Ctrl-C to stop", style="dim")
                    live.update(Group(status_table(rows, interval), stamp), refresh=True)
        except KeyboardInterrupt:
            return
    try:
        rows, _ = observe(targets, hosts, thresholds, interval, timeout, traffic=traffic)
    finally:
        if traffic is not None:
            traffic.close()
    if as_json:
        data = {"instances": [status_data(r) for r in rows], "hosts_without_plan": unplanned}
        click.echo(json.dumps(data, indent=2))
    else:
        console().print(status_table(rows, interval))
        if unplanned:
            console().print(f"[yellow]not observed (no valid plan, so no instances):[/] {', '.join(unplanned)}")
    sys.exit(0 if all(r.ok for r in rows) and not unplanned else 1)


def _traffic(loaded: LoadedInventory, targets: list[Target], ssh: bool) -> Traffic | None:
    """The balancers in front of the targets (without SSH: only those on this machine)."""
    from fleet.lb.traffic import Traffic, traffic_of

    traffic = traffic_of(loaded, [(t.host, f"vllm-{t.index}") for t in targets])
    if not ssh:
        traffic = Traffic({k: v for k, v in traffic.seats.items() if v.balancer.spec.local})
    return traffic or None
