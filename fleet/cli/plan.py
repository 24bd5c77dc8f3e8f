"""``fleet plan``: the serving plan per host, with its reasons. Changes nothing on any host.

GPU facts come from probing the hosts (the NVML probe, read-only) where they answer; a host that
does not, and every host with ``--offline``, is planned from the inventory's ``gpu`` data.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from fleet.cli import EXIT_INVALID, EXIT_OK, EXIT_SOME_HOSTS, console, debug_option, fail
from fleet.errors import FleetError, InventoryError
from fleet.facts import PROBE_CONNECT_TIMEOUT
from fleet.secrets import redact_data


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--limit", multiple=True, help="Only these hosts or groups (repeatable; globs allowed).")
@click.option("--json", "as_json", is_flag=True, help="Print the plans as JSON.")
@click.option(
    "--render",
    "render_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write each host's systemd units and env files under DIR/<host>/.",
)
@click.option(
    "--observed",
    is_flag=False,
    flag_value="instances",
    default=None,
    metavar="[PROMETHEUS_URL]",
    help="Plan from observed traffic: read the serving instances (or this Prometheus) and show the change.",
)
@click.option("--offline", is_flag=True, help="Do not probe the hosts: plan from the inventory's gpu data.")
@click.option(
    "--probe-timeout",
    type=click.FloatRange(min=0.1, max=600),
    default=PROBE_CONNECT_TIMEOUT,
    show_default=True,
    metavar="SECONDS",
    help="How long to wait for each host's SSH port (all hosts at once); a host that does not answer is "
    "planned from the inventory's gpu data.",
)
@debug_option
def plan(
    inventory: str,
    limit: tuple[str, ...],
    as_json: bool,
    render_dir: Path | None,
    observed: str | None,
    offline: bool,
    probe_timeout: float,
) -> None:
    """The serving plan per host: flags, memory math and reasons. Changes nothing on any host.

    GPU facts are probed from the hosts that answer (read-only); --offline uses the inventory.
    Exit 0: every host has a plan; 1: some host has none; 2: invalid input (nothing is planned
    or written); 3: a bug in fleet.
    """
    if observed is not None:  # fleet.monitor.observed; same as `fleet monitor observe`
        from fleet.cli.monitor import print_observed

        print_observed(inventory, limit, None if observed == "instances" else observed, "7d", 10.0, as_json)
        return
    from fleet.cli.plan_view import print_plans
    from fleet.inventory.ports import plan_port_problems
    from fleet.plan.outcomes import outcome_data, plan_fleet
    from fleet.render.units import host_render_dir, render_host, write_tree

    try:
        fleet_plan = plan_fleet(inventory, list(limit) or None, offline, probe_timeout)
    except InventoryError as exc:
        fail(str(exc), as_json, EXIT_INVALID, [p.data() for p in exc.problems])
    except FleetError as exc:
        fail(str(exc), as_json, EXIT_INVALID)
    outcomes, notes = fleet_plan.outcomes, fleet_plan.not_probed
    invalid = [o for o in outcomes if o.invalid_input and o.problem is not None]
    if invalid:  # a model config.json that cannot be read: input, like the inventory
        fail("\n".join(str(o.problem) for o in invalid), as_json, EXIT_INVALID)
    # Now that instances have ports, check them across hosts (a host's range is only known here).
    clashes = plan_port_problems((o.spec, [i.port for i in o.plan.instances]) for o in outcomes if o.plan is not None)
    if clashes:
        fail(str(InventoryError(clashes)), as_json, EXIT_INVALID, [p.data() for p in clashes])
    if render_dir is not None:
        for outcome in outcomes:
            if outcome.plan is not None:
                ref = str(outcome.spec.api_key_ref) if outcome.spec.api_key_ref else None
                write_tree(host_render_dir(render_dir, outcome.spec.name), render_host(outcome.plan, None, ref))
    if as_json:
        data = {"hosts": [outcome_data(o) for o in outcomes], "not_probed": notes}
        click.echo(json.dumps(redact_data(data), indent=2))
    else:
        for host, note in notes.items():
            click.echo(f"{host}: {note}; planned from the inventory's gpu data", err=True)
        print_plans(console(), outcomes)
        if render_dir is not None:
            console().print(f"units and env files written under {render_dir}/<host>/", markup=False)
    sys.exit(EXIT_OK if all(o.ok for o in outcomes) else EXIT_SOME_HOSTS)
