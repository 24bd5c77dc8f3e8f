"""``fleet gpu clear INVENTORY HOST GPU --why TEXT``: lift a GPU's quarantine after repair.

Thin over ``fleet.rollout.gpu_clear`` (and ``fleet.gpuwatch.clear``): the host must be one of the
inventory's, the GPU one its watcher knows and quarantined; who (``user@control-machine``), when
and ``--why`` are kept on the host (the watcher's ``clears.json``), in its system journal and in
fleet's own journal beside the rollouts (``fleet history``).
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from fleet.cli import EXIT_SOME_HOSTS, console, fail
from fleet.cli.history import JOURNAL_HELP
from fleet.errors import FleetError


@click.group()
def gpu() -> None:
    """GPUs the watcher quarantined: lift a quarantine after repair."""


@gpu.command()
@click.argument("inventory", type=click.Path(dir_okay=False, exists=True))
@click.argument("host")
@click.argument("index", metavar="GPU", type=click.IntRange(min=0))
@click.option("--why", required=True, help="What was repaired (kept on the host and in the journal with who and when).")
@click.option("--journal", "journal_path", metavar="PATH|URL", help=JOURNAL_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def clear(inventory: str, host: str, index: int, why: str, journal_path: str | None, as_json: bool) -> None:
    """Lift the quarantine of GPU (its NVML index) on HOST: planning and deploys use it again.

    Who, when and why are kept on the host and in fleet's journal (`fleet history` lists the
    clear as kind gpu-clear; `fleet history ID` shows it). Exit code 0 when cleared, 1 when the
    host could not be read or written (or its watcher record cannot be used) or the journal
    cannot be written, 2 on invalid input (an unknown host, a GPU the watcher does not know or
    that is not quarantined, a bad --why).
    """
    from fleet.facts.runner import targets_from_inventory
    from fleet.gpuwatch.clear import ClearRefused
    from fleet.inventory.schema import DRAIN_REASON_RULE, drain_reason
    from fleet.plan.outcomes import load_for_planning
    from fleet.rollout.drain import who
    from fleet.rollout.errors import JournalError
    from fleet.rollout.gpu_clear import clear_journaled
    from fleet.rollout.journal import locate
    from fleet.secrets import shown

    try:
        reason = drain_reason(why)  # the same rule as `fleet drain --reason`
    except ValueError:
        fail(f"--why {shown(why)}: {DRAIN_REASON_RULE}; nothing was cleared", as_json)
    try:
        where = locate(journal_path)  # a bad --journal / FLEET_JOURNAL: before any host is touched
    except JournalError as exc:
        fail(str(exc), as_json)
    try:
        loaded = load_for_planning(inventory, [host])
        if [s.name for s in loaded.hosts] != [host]:
            fail(f"{host}: not a vLLM host of {inventory} (give one host's name); nothing was cleared", as_json)
        (target,) = targets_from_inventory(loaded.pyinfra, [host])
    except FleetError as exc:
        fail(str(exc), as_json)
    fleet = str(Path(loaded.path).resolve())  # the name rollouts journal this fleet by
    try:
        done = clear_journaled(fleet, target, index, who(), reason, journal_path=where)
    except ClearRefused as exc:
        fail(str(exc), as_json)
    except FleetError as exc:  # the host could not be read or written, or the journal
        fail(str(exc), as_json, code=EXIT_SOME_HOSTS)
    if as_json:
        click.echo(json.dumps({"host": host, "gpu": index, "cleared": done.text, "journal": done.rollout_id}))
    else:
        out = console()
        out.print(f"host {host}: {done.text}", soft_wrap=True, markup=False)
        out.print(f"journaled as {done.rollout_id} in {where} (fleet history {done.rollout_id})", soft_wrap=True,
                  markup=False)  # fmt: skip
