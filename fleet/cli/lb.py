"""``fleet lb``: the load balancers in front of the fleet (HAProxy), from the inventory.

Thin commands over ``fleet.lb``: ``export`` writes each balancer's configuration; ``show`` prints
what each balancer says about every instance (its state and sessions); ``ready`` puts instances
back into traffic (what a halted rollout names when it left one out).
"""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from fleet.cli import EXIT_INVALID, EXIT_SOME_HOSTS, console, fail
from fleet.errors import FleetError


@click.group()
def lb() -> None:
    """Load balancers in front of the fleet (HAProxy): configuration and runtime state."""


@lb.command("export")
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--limit", multiple=True, help="Only these hosts or groups (repeatable; globs allowed).")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def export(inventory: str, directory: Path, limit: tuple[str, ...], as_json: bool) -> None:
    """Write DIR/<balancer>/haproxy.cfg for every balancer the INVENTORY names, from its plan.

    A backend per served model, every planned instance a server named HOST:INSTANCE, written
    `disabled` (fleet sets a server `ready` once its instance passes its gates), with health
    checks on /health and HAProxy's runtime state kept across reloads. Hosts are planned from
    their inventory `gpu` entries (a host without one has no server yet: `fleet deploy` writes it
    once it probed the host). Check a result with `haproxy -c -f DIR/<balancer>/haproxy.cfg`.
    """
    from fleet.lb.config import export_files, fleet_configs
    from fleet.plan.outcomes import build_fleet_plan, load_for_planning
    from fleet.render.units import write_tree

    try:
        loaded = load_for_planning(inventory, list(limit) or None)
        outcomes = build_fleet_plan(loaded).outcomes
        configs = fleet_configs(loaded, {o.spec.name: o.plan for o in outcomes})
    except FleetError as exc:
        fail(str(exc), as_json)
    if not configs:
        fail(f"{inventory}: no host has a `balancer` entry (or none has a plan): nothing to write", as_json)
    written = write_tree(directory, export_files(configs, inventory))
    unplanned = [
        o.spec.name for o in outcomes if o.plan is None and any(m.balancer is not None for m in o.spec.model_specs)
    ]
    if as_json:
        body = {
            "directory": str(directory),
            "files": [str(p) for p in written],
            "balancers": [
                {
                    "on": c.spec.on,
                    "admin_socket": c.spec.admin_socket,
                    "backends": [
                        {"name": b.name, "bind": b.bind, "servers": [s.name for s in b.servers]} for b in c.backends
                    ],
                }
                for c in configs
            ],
            "hosts_without_plan": unplanned,
        }
        click.echo(json.dumps(body, indent=2))
        return
    out = console()
    for c in configs:
        servers = sum(len(b.servers) for b in c.backends)
        out.print(f"{escape(c.spec.describe())}: {len(c.backends)} backend(s), {servers} server(s)")
    for path in written:
        out.print(f"  {path}")
    if unplanned:
        out.print(f"[yellow]no plan (no server yet):[/] {', '.join(unplanned)} — see `fleet plan {inventory}`")


@lb.command("show")
@click.argument("inventory", type=click.Path(dir_okay=False, exists=True))
@click.option("--limit", multiple=True, help="Only these hosts or groups (repeatable; globs allowed).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def show(inventory: str, limit: tuple[str, ...], as_json: bool) -> None:
    """What each balancer says about every planned instance: UP/DRAIN/MAINT/DOWN, sessions, queue."""
    traffic, order = _traffic(inventory, limit, as_json)
    rows = []
    code = 0
    for host, instance in order:
        seat = traffic.seat(host, instance)
        if seat is None:
            continue
        try:
            v = seat.balancer.view(seat.backend, seat.server)
            rows.append({"instance": f"{host}/{instance}", "backend": v.backend, "server": v.server, "view": v.view,
                         "admin": v.admin.value, "status": v.status, "sessions": v.sessions, "queued": v.queued,
                         "check": v.check, "error": None})  # fmt: skip
        except FleetError as exc:
            code = EXIT_SOME_HOSTS
            rows.append({"instance": f"{host}/{instance}", "backend": seat.backend, "server": seat.server,
                         "error": str(exc)})  # fmt: skip
    traffic.close()
    if as_json:
        click.echo(json.dumps({"servers": rows}, indent=2))
    else:
        table = Table(title=f"balancers of {inventory}")
        for col in ("instance", "server", "state", "sessions", "queued", "check"):
            table.add_column(col)
        for r in rows:
            if r.get("error"):
                table.add_row(r["instance"], f"{r['backend']}/{r['server']}", f"[red]{escape(r['error'])}[/]")
                continue
            table.add_row(r["instance"], f"{r['backend']}/{r['server']}", f"{r['view']} ({r['admin']})",
                          str(r["sessions"]), str(r["queued"]), r["check"])  # fmt: skip
        console().print(table)
    raise SystemExit(code)


@lb.command("ready")
@click.argument("inventory", type=click.Path(dir_okay=False, exists=True))
@click.argument("instances", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ready(inventory: str, instances: tuple[str, ...], as_json: bool) -> None:
    """Put INSTANCES (HOST/vllm-N) back into traffic: `set server ... state ready` on their balancer.

    For an instance a halted rollout left out of traffic once you checked it serves. A drained
    host (`fleet drain`) comes back with `fleet undrain`, not with this.
    """
    wanted = []
    for text in instances:
        host, sep, inst = text.partition("/")
        if not sep or not host or not inst:
            fail(f"{text!r}: an instance is HOST/vllm-N", as_json)
        wanted.append((host, inst))
    traffic, order = _traffic(inventory, tuple(sorted({h for h, _ in wanted})), as_json)
    unknown = [f"{h}/{i}" for h, i in wanted if (h, i) not in order or traffic.seat(h, i) is None]
    if unknown:
        traffic.close()
        fail(f"not an instance behind a balancer in {inventory}: {', '.join(unknown)}", as_json)
    from fleet.lb.runtime import AdminState

    done = []
    try:
        for h, i in wanted:
            traffic.set_state(h, i, AdminState.READY)
            done.append(f"{h}/{i}")
    except FleetError as exc:
        fail(f"{exc} (back in traffic before this: {', '.join(done) or 'none'})", as_json, code=EXIT_SOME_HOSTS)
    finally:
        traffic.close()
    if as_json:
        click.echo(json.dumps({"ready": done}, indent=2))
    else:
        console().print(f"back in traffic: {', '.join(done)}")


def _traffic(inventory: str, limit: tuple[str, ...], as_json: bool):  # type: ignore[no-untyped-def]
    """The balancer seats of every planned instance (planned from the inventory's gpu entries, or probed)."""
    from fleet.lb.traffic import traffic_of
    from fleet.plan.outcomes import load_for_planning
    from fleet.rollout.fleet_inventory import fleet_of

    try:
        loaded = load_for_planning(inventory, list(limit) or None)
        fleet = fleet_of(loaded)
        served = {(r.host, r.instance): s.model for r, s in fleet.instances.items()}
        order = list(served)
        return traffic_of(loaded, order, served=served), order
    except FleetError as exc:
        fail(str(exc), as_json, code=EXIT_INVALID)
