"""``fleet drain`` / ``fleet undrain``: hosts out of service for maintenance, and back.

Thin: the work is ``fleet.rollout.drain`` (the rolling engine with ``stop_only`` targets, the
host's marker, the units' enablement); this module reads the options, shows the live view of
``fleet restart`` and reports like it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from fleet.cli import fail
from fleet.errors import FleetError

if TYPE_CHECKING:
    from fleet.rollout.fleet_inventory import RolloutFleet


def _options(f: Any) -> Any:
    opts = [
        click.option("--drain-timeout", "drain_timeout_s", type=float,
                     help="Seconds to wait for the balancer's sessions, then for vLLM's requests, to end (each)."),
        click.option("--health-timeout", type=float, help="Seconds an instance may take to load (undrain)."),
        click.option("--take-over", is_flag=True, help="Take over a stale lock (its owner is gone)."),
        click.option("--no-lb", is_flag=True,
                     help="Without the load balancers (clients will see failed requests; said once)."),
        click.option("--journal", "journal_path", type=click.Path(dir_okay=False, path_type=Path),
                     help="The journal database (default: $FLEET_JOURNAL or ~/.local/state/fleet/journal.sqlite)."),
        click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (no live view)."),
    ]  # fmt: skip
    for opt in reversed(opts):
        f = opt(f)
    return f


def _overrides(opts: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if opts.get("drain_timeout_s") is not None:
        out["drain_timeout_s"] = opts["drain_timeout_s"]
    if opts.get("health_timeout") is not None:
        out["timeouts.health"] = opts["health_timeout"]
    return out


def _fleet(inventory: str, hosts: tuple[str, ...], as_json: bool) -> RolloutFleet:
    """The fleet of exactly these hosts (names, not groups or patterns: a drain is deliberate),
    drained or not."""
    from fleet.plan.outcomes import load_for_planning
    from fleet.rollout.fleet_inventory import fleet_of

    try:
        loaded = load_for_planning(inventory, list(hosts))
        selected = {s.name for s in loaded.hosts}
        unknown = [h for h in hosts if h not in selected]
        if unknown or len(selected) != len(set(hosts)):
            fail(f"{', '.join(unknown) or ' '.join(hosts)}: give the names of vLLM hosts of {inventory} (not groups, "
                 f"patterns or balancer hosts); nothing was touched", as_json)  # fmt: skip
        return fleet_of(loaded)
    except FleetError as exc:
        fail(str(exc), as_json)


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False, exists=True))
@click.argument("hosts", nargs=-1, required=True)
@click.option("--reason", required=True, help="Why (kept on each host with who and when; `fleet status` shows it).")
@_options
def drain(inventory: str, hosts: tuple[str, ...], reason: str, **opts: Any) -> None:
    """Take HOSTS out of service for maintenance: out of traffic, stopped, marked drained.

    Each host is first marked drained on the host itself (/var/lib/fleet/drained.json, root-only:
    who, when, --reason), so rollouts, restarts and deploys from any control machine skip it; then
    every instance of it leaves its load balancer's traffic (HAProxy `drain`), its sessions and
    requests finish, its unit is stopped and disabled, and its server is left in `maint`.
    Journaled like a rollout (`fleet history`). `fleet undrain` puts the hosts back.
    Exit status 0 when every instance is stopped, 1 when the drain halted, 2 on invalid input.
    """
    from fleet.cli.rollout import guarded, live_loop, report_state, warn_to_stderr
    from fleet.inventory.schema import DRAIN_REASON_RULE, drain_reason
    from fleet.rollout import drain as maintenance
    from fleet.secrets import shown

    as_json = bool(opts["as_json"])
    try:
        why = drain_reason(reason)
    except ValueError:
        fail(f"--reason {shown(reason)}: {DRAIN_REASON_RULE}; nothing was touched", as_json)
    fleet = _fleet(inventory, hosts, as_json)
    final = guarded(
        lambda: maintenance.drain(
            fleet, why, overrides=_overrides(opts), journal_path=opts["journal_path"], take_over=opts["take_over"],
            lb=not opts["no_lb"], run=live_loop(as_json), warn=warn_to_stderr(as_json),
        ),
        as_json,
    )  # fmt: skip
    report_state(final, as_json)


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False, exists=True))
@click.argument("hosts", nargs=-1, required=True)
@_options
def undrain(inventory: str, hosts: tuple[str, ...], **opts: Any) -> None:
    """Put drained HOSTS back into service: start, gate, back into traffic, unmark.

    Each host's units are enabled again; every instance is started on the release its host's
    `current` link names, must pass its gates (unit, /health, /v1/models, a real completion, the
    soak) and is set `ready` on its load balancer; then the host's drain marker is removed. A host
    with an instance that does not come back stays marked drained. Exit status 0 when every
    instance serves, 1 when the undrain halted, 2 on invalid input.
    """
    from fleet.cli.rollout import guarded, live_loop, report_state, warn_to_stderr
    from fleet.rollout import drain as maintenance

    as_json = bool(opts["as_json"])
    fleet = _fleet(inventory, hosts, as_json)
    final = guarded(
        lambda: maintenance.undrain(
            fleet, overrides=_overrides(opts), journal_path=opts["journal_path"], take_over=opts["take_over"],
            lb=not opts["no_lb"], run=live_loop(as_json), warn=warn_to_stderr(as_json),
        ),
        as_json,
    )  # fmt: skip
    report_state(final, as_json)
