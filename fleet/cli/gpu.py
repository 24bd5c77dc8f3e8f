"""``fleet gpu clear INVENTORY HOST GPU --why TEXT``: lift a GPU's quarantine after repair.

Thin over ``fleet.gpuwatch.clear``: the host must be one of the inventory's, the GPU one its
watcher knows and quarantined; who (``user@control-machine``), when and ``--why`` are kept on the
host (the watcher's ``clears.json``) and in its system journal.
"""

from __future__ import annotations

import json
import time

import click

from fleet.cli import EXIT_SOME_HOSTS, console, fail
from fleet.errors import FleetError


@click.group()
def gpu() -> None:
    """GPUs the watcher quarantined: lift a quarantine after repair."""


@gpu.command()
@click.argument("inventory", type=click.Path(dir_okay=False, exists=True))
@click.argument("host")
@click.argument("index", metavar="GPU", type=click.IntRange(min=0))
@click.option("--why", required=True, help="What was repaired (kept on the host with who and when).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def clear(inventory: str, host: str, index: int, why: str, as_json: bool) -> None:
    """Lift the quarantine of GPU (its NVML index) on HOST: planning and deploys use it again.

    Exit code 0 when cleared, 1 when the host could not be read or written, 2 on invalid input
    (an unknown host, a GPU the watcher does not know or that is not quarantined, a bad --why).
    """
    from fleet.facts.runner import targets_from_inventory
    from fleet.gpuwatch.clear import ClearRefused, clear_gpu
    from fleet.inventory.schema import drain_reason
    from fleet.plan.outcomes import load_for_planning
    from fleet.rollout.drain import who

    try:
        reason = drain_reason(why)  # the same rule as `fleet drain --reason`
    except ValueError as exc:
        fail(f"--why {why!r}: {exc}", as_json)
    try:
        loaded = load_for_planning(inventory, [host])
        if [s.name for s in loaded.hosts] != [host]:
            fail(f"{host}: not a vLLM host of {inventory} (give one host's name); nothing was cleared", as_json)
        (target,) = targets_from_inventory(loaded.pyinfra, [host])
    except FleetError as exc:
        fail(str(exc), as_json)
    try:
        text = clear_gpu(target, index, who(), reason, time.time())
    except ClearRefused as exc:
        fail(str(exc), as_json)
    except FleetError as exc:  # the host could not be read or written
        fail(str(exc), as_json, code=EXIT_SOME_HOSTS)
    if as_json:
        click.echo(json.dumps({"host": host, "gpu": index, "cleared": text}))
    else:
        console().print(f"host {host}: {text}", soft_wrap=True, markup=False)
