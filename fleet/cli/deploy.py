"""``fleet deploy``: driver, vLLM release and units on each host; first deploy starts and waits."""

from __future__ import annotations

from typing import Any

import click
from rich.console import Console

from fleet.cli import fail
from fleet.cli.deploy_view import HostSteps, report
from fleet.errors import FleetError


@click.command()
@click.argument("inventory", type=click.Path(dir_okay=False))
@click.option("--limit", multiple=True, help="Only these hosts or groups (repeatable; globs allowed).")
@click.option("--dry", is_flag=True, help="Show per host what would change; touch nothing.")
@click.option("--no-start", is_flag=True, help="Install only: do not start units or wait for health.")
@click.option("--health-timeout", type=click.FloatRange(1, 7200), default=300, show_default=True, help="Seconds.")
@click.option(
    "--fail-percent", type=click.IntRange(0, 100), default=0, show_default=True,
    help="Stop scheduling hosts once more than this % failed (0: at the first failure).",
)  # fmt: skip
@click.option("--reboot", is_flag=True, help="Reboot hosts whose driver change needs it, one at a time.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--ignore-finding", "ignore_finding", multiple=True, metavar="RULE",
              help="Deploy even though the audit finds RULE (e.g. gpu-missing) on a host (repeatable).")  # fmt: skip
def deploy(
    inventory: str,
    limit: tuple[str, ...],
    dry: bool,
    no_start: bool,
    health_timeout: float,
    fail_percent: int,
    reboot: bool,
    as_json: bool,
    ignore_finding: tuple[str, ...],
) -> None:
    """Install the NVIDIA driver, the vLLM release and the units; a first deploy starts them.

    A host with a critical audit finding (``fleet audit``; not those the deploy fixes itself: no
    driver yet, a driver waiting for its reboot) is refused before anything is written to it,
    naming the finding and its way out; ``--ignore-finding RULE`` lets it through.

    Exit status 1 when a host failed, was refused or an instance is not healthy, 2 when the
    inventory (or an option) is invalid.
    """
    from fleet.audit.gate import check_ignored

    try:
        ignored = check_ignored(ignore_finding)
    except ValueError as exc:
        fail(str(exc), as_json)
    # pyinfra runs hosts in parallel on gevent greenlets; without patching, SSH sockets block and
    # hosts go one after another (pyinfra's own CLI patches first thing, too).
    from gevent import monkey

    monkey.patch_all()
    from fleet.deploy.runner import deploy as run_deploy

    def roll(*args: Any, **kwargs: Any) -> Any:  # the rolling engine's CLI, imported only when a deploy rolls
        from fleet.cli.rollout import roll as roll_with_view

        return roll_with_view(*args, **kwargs)

    opts = {"as_json": as_json, "ignore_finding": ignored}
    err = Console(stderr=True, highlight=False)
    try:
        with HostSteps(err) as steps:
            result = run_deploy(
                inventory, list(limit) or None, dry=dry, start=not no_start, health_timeout=health_timeout,
                progress=steps.note, fail_percent=fail_percent, step=steps.step, reboot=reboot,
                roll=steps.paused(lambda fleet, targets_of: roll(fleet, "rollout", targets_of, opts,
                                                                 overridden=fleet.gate(ignored).overridden)),
                ignore_findings=ignored,
            )  # fmt: skip
    except FleetError as exc:
        fail(str(exc), as_json)
    report(result, as_json, "fleet deploy" + (" --dry" if dry else ""))
